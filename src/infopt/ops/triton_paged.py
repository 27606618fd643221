"""Triton kernels for paged attention on CUDA. The decode kernel: one new token per sequence, reading each sequence's
keys and values in place through its block table, with the lengths read on the device.

:func:`paged_decode` computes what :func:`infopt.ops.paged_attention.decode_sdpa` computes (the reference, which
gathers every row's blocks up to the table's width and runs one masked SDPA) without the gather: program ``(s, g, p)``
takes sequence ``s``'s query heads of KV head ``g`` (a grouped-query group reads its keys once), walks part ``p`` of
the blocks the sequence holds (split-K: long contexts are spread over several programs), and keeps an online softmax
in fp32. The parts' ``(max, sum, weighted values)`` are merged by a few torch ops after the launch. Nothing is read
back to the host, so a CUDA graph captures the launch. Keys past a sequence's length, or before its sliding window,
are skipped, not gathered and masked: the work follows the real lengths, not the table's width.

:func:`paged_prefill` serves the other packed steps (prompt chunks beside decode tokens): every token of the step in
one launch, :data:`PREFILL_BQ` tokens of one sequence times a KV head's group per program, its programs listed by
:func:`prefill_tiles` from the lengths the host laid out. :func:`paged_attention_triton` is both as one operator for a
compiled forward.

Checked in Triton's CPU interpreter (``TRITON_INTERPRET=1``) against the reference; the decode kernel also on an
H200 (the ninth GPU lane run, docs/gpu.md); the packed kernel and the operator have not run on a GPU yet.
"""

# no `from __future__ import annotations`: torch.library.custom_op reads the op's schema from real annotations
import functools

import torch

from .triton_int8 import _interpreting, triton_available

__all__ = ["paged_decode", "paged_prefill", "prefill_tiles", "available", "applies", "decode_splits", "kernel_calls",
           "paged_attention_triton", "PREFILL_BQ"]

triton = tl = None  # bound by _kernel(), on the first launch
_CALLS = {"triton": 0, "triton_prefill": 0}
PREFILL_BQ = 16  # query tokens of one sequence per program of :func:`paged_prefill`


def kernel_calls() -> dict[str, int]:
    """Launches of :func:`paged_decode` (``triton``) and :func:`paged_prefill` (``triton_prefill``) since import.

    Example:
        >>> sorted(kernel_calls())
        ['triton', 'triton_prefill']
    """
    return dict(_CALLS)


def available(query: torch.Tensor) -> bool:
    """Whether :func:`paged_decode` runs for ``query``: Triton installed, and a CUDA tensor (or Triton's CPU
    interpreter), in fp32, fp16 or bf16.

    Example:
        >>> available(torch.zeros(1, 2, 8)) in (True, False)
        True
    """
    return ((query.is_cuda or _interpreting()) and query.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and triton_available())


def applies(device: torch.device, dtype: torch.dtype) -> bool:
    """:func:`available` for a model's device and dtype, without a tensor (decided outside a compiled graph)."""
    return ((device.type == "cuda" or _interpreting()) and dtype in (torch.float32, torch.float16, torch.bfloat16)
            and triton_available())


def decode_splits(seqs: int, kv_heads: int, max_blocks: int, programs: int = 264) -> int:
    """How many parts each sequence's blocks are split into: enough programs to fill ``programs`` (about two per SM
    of an H100/H200), at least 4 blocks per part, from shapes only (no value read back).

    Example:
        >>> decode_splits(1, 8, 512), decode_splits(64, 8, 512), decode_splits(2, 2, 3)
        (33, 1, 1)
    """
    want = -(-programs // max(1, seqs * kv_heads))
    return max(1, min(want, max_blocks // 4))


@functools.cache
def _kernel():
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, m_ptr, l_ptr, acc_ptr, scale, window,
                            stride_qs, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                            stride_ts, H, G: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr, BSP: tl.constexpr,
                            D: tl.constexpr, DP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
                            SPLITS: tl.constexpr):
        s = tl.program_id(0)
        kvh = tl.program_id(1)
        part = tl.program_id(2)
        kv_len = tl.load(lens_ptr + s)
        lo = tl.where(window > 0, tl.maximum(kv_len - window, 0), 0)  # the first key the token may see
        first = lo // BS
        n_blocks = (kv_len + BS - 1) // BS
        per = (n_blocks - first + SPLITS - 1) // SPLITS
        b0 = first + part * per
        b1 = tl.minimum(b0 + per, n_blocks)
        offs_g = tl.arange(0, GP)
        offs_t = tl.arange(0, BSP)
        offs_d = tl.arange(0, DP)
        offs_v = tl.arange(0, DVP)
        g_ok = offs_g < G
        heads = kvh * G + offs_g
        q = tl.load(q_ptr + s * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_ok[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)  # [GP, DP]
        m = tl.full([GP], float("-inf"), tl.float32)
        den = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DVP], tl.float32)
        for j in range(b0, b1):
            blk = tl.load(table_ptr + s * stride_ts + j).to(tl.int64)
            pos = j * BS + offs_t
            t_ok = (offs_t < BS) & (pos < kv_len) & (pos >= lo)
            k = tl.load(k_ptr + blk * stride_kb + offs_t[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                        mask=t_ok[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)  # [BSP, DP]
            qk = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GP, BSP]
            qk = tl.where(t_ok[None, :], qk, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
            p = tl.exp(qk - m_use[:, None])
            alpha = tl.exp(m - m_use)
            v = tl.load(v_ptr + blk * stride_vb + offs_t[:, None] * stride_vt + kvh * stride_vh + offs_v[None, :],
                        mask=t_ok[:, None] & (offs_v[None, :] < DV), other=0.0).to(tl.float32)  # [BSP, DVP]
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            den = den * alpha + tl.sum(p, axis=1)
            m = m_new
        row = (s * H + heads) * SPLITS + part  # [GP]: this part's slot of each head
        tl.store(m_ptr + row, m, mask=g_ok)
        tl.store(l_ptr + row, den, mask=g_ok)
        tl.store(acc_ptr + row[:, None] * DV + offs_v[None, :], acc, mask=g_ok[:, None] & (offs_v[None, :] < DV))

    return paged_decode_kernel


def _shapes(op: str, rows: str, query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor) -> tuple:
    """``(rows, H, D, block_size, H_kv, Dv, group)`` of a call, or a ValueError naming ``op``."""
    if query.dim() != 3 or key_pool.dim() != 4 or query.shape[1] % key_pool.shape[2]:
        raise ValueError(f"{op}: query {tuple(query.shape)} and pool {tuple(key_pool.shape)}; allowed: "
                         f"[{rows}, H, D] queries over [blocks, block_size, H_kv, D] pools, H a multiple of H_kv")
    n, h, d = query.shape
    _, bs, h_kv, _ = key_pool.shape
    return n, h, d, bs, h_kv, value_pool.shape[-1], h // h_kv


def _launch(kernel, grid: tuple, args: tuple, meta: dict, query: torch.Tensor) -> None:
    if query.is_cuda:
        with torch.cuda.device(query.device):
            kernel[grid](*args, **meta)
    else:  # TRITON_INTERPRET=1 on CPU tensors
        kernel[grid](*args, **meta)


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << (max(1, n) - 1).bit_length())


def paged_decode(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, block_table: torch.Tensor,
                 kv_lens: torch.Tensor, scale: float, window: int | None = None, splits: int | None = None
                 ) -> torch.Tensor:
    """Decode attention through the block tables (module docstring): ``query [S, H, D]`` (token ``i`` is sequence
    ``i``'s, at position ``kv_lens[i] - 1``), pools ``[num_blocks, block_size, H_kv, D]``, ``block_table [S, W]``
    (int32 or int64), ``kv_lens [S]`` -> ``[S, H, Dv]`` in the query's dtype. ``splits``: parts per sequence
    (default :func:`decode_splits`).

    Raises:
        ValueError: heads that are not a multiple of the KV heads, or a query that is not ``[S, H, D]``.
    """
    s, h, d, bs, h_kv, dv, g = _shapes("paged_decode", "S", query, key_pool, value_pool)
    splits = splits or decode_splits(s, h_kv, block_table.shape[1])
    m = torch.empty(s, h, splits, dtype=torch.float32, device=query.device)
    den = torch.empty_like(m)
    acc = torch.empty(s, h, splits, dv, dtype=torch.float32, device=query.device)
    if s:
        table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
        lens = kv_lens.contiguous()
        kernel = _kernel()
        grid = (s, h_kv, splits)
        args = (query, key_pool, value_pool, table, lens, m, den, acc, float(scale), int(window or 0),
                query.stride(0), query.stride(1), key_pool.stride(0), key_pool.stride(1), key_pool.stride(2),
                value_pool.stride(0), value_pool.stride(1), value_pool.stride(2), table.stride(0), h)
        meta = {"G": g, "GP": _pow2(g), "BS": bs, "BSP": _pow2(bs), "D": d, "DP": _pow2(d), "DV": dv, "DVP": _pow2(dv)}
        _launch(kernel, grid, args, {**meta, "SPLITS": splits}, query)
    _CALLS["triton"] += 1
    # merge the parts: a part that saw no key has max -inf and weight 0
    top = m.amax(-1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w = torch.exp(m - top)  # [S, H, P]
    total = (den * w).sum(-1, keepdim=True)  # [S, H, 1]
    out = (acc * w[..., None]).sum(-2) / total
    return out.to(query.dtype)


def prefill_tiles(new_lens, bq: int = PREFILL_BQ) -> list[tuple[int, int]]:
    """The programs of :func:`paged_prefill` for a step whose sequences bring ``new_lens`` tokens each (host ints,
    known when the step was laid out): ``(sequence, first of its new tokens)`` for every ``bq`` of them.

    Example:
        >>> prefill_tiles([1, 20, 0, 16], bq=16)
        [(0, 0), (1, 0), (1, 16), (3, 0)]
    """
    return [(s, t) for s, n in enumerate(new_lens) for t in range(0, int(n), bq)]


@functools.cache
def _prefill_kernel():
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit
    def paged_prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, lens_ptr, news_ptr, starts_ptr, tiles_ptr,
                             scale, window, stride_qn, stride_qh, stride_on, stride_oh, stride_kb, stride_kt,
                             stride_kh, stride_vb, stride_vt, stride_vh, stride_ts, G: tl.constexpr,
                             GP: tl.constexpr, BQ: tl.constexpr, BS: tl.constexpr, BSP: tl.constexpr,
                             D: tl.constexpr, DP: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
                             PRECISION: tl.constexpr):
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.load(tiles_ptr + 2 * tile)
        t0 = tl.load(tiles_ptr + 2 * tile + 1)
        kv_len = tl.load(lens_ptr + s)
        n_new = tl.load(news_ptr + s)
        start = tl.load(starts_ptr + s)
        r = tl.arange(0, BQ * GP)  # rows: BQ query tokens x the GP heads of KV head kvh's group
        tok = t0 + r // GP
        g = r % GP
        r_ok = (tok < n_new) & (g < G)
        heads = kvh * G + g
        qpos = kv_len - n_new + tok  # each query's position: it sees keys up to itself
        lo = tl.where(window > 0, tl.maximum(qpos - window + 1, 0), 0)
        offs_t = tl.arange(0, BSP)
        offs_d = tl.arange(0, DP)
        offs_v = tl.arange(0, DVP)
        q = tl.load(q_ptr + (start + tok)[:, None] * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=r_ok[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)  # [R, DP]
        m = tl.full([BQ * GP], float("-inf"), tl.float32)
        den = tl.zeros([BQ * GP], tl.float32)
        acc = tl.zeros([BQ * GP, DVP], tl.float32)
        first_q = kv_len - n_new + t0
        last = tl.minimum(first_q + BQ, kv_len) - 1  # the tile's last query position
        b0 = tl.where(window > 0, tl.maximum(first_q - window + 1, 0), 0) // BS
        for j in range(b0, last // BS + 1):
            blk = tl.load(table_ptr + s * stride_ts + j).to(tl.int64)
            pos = j * BS + offs_t
            t_ok = (offs_t < BS) & (pos <= last)
            k = tl.load(k_ptr + blk * stride_kb + offs_t[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                        mask=t_ok[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)  # [BSP, DP]
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [R, BSP]
            ok = r_ok[:, None] & t_ok[None, :] & (pos[None, :] <= qpos[:, None]) & (pos[None, :] >= lo[:, None])
            qk = tl.where(ok, qk, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
            p = tl.exp(qk - m_use[:, None])
            alpha = tl.exp(m - m_use)
            v = tl.load(v_ptr + blk * stride_vb + offs_t[:, None] * stride_vt + kvh * stride_vh + offs_v[None, :],
                        mask=t_ok[:, None] & (offs_v[None, :] < DV), other=0.0).to(tl.float32)  # [BSP, DVP]
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            den = den * alpha + tl.sum(p, axis=1)
            m = m_new
        out = acc / tl.where(den > 0, den, 1.0)[:, None]
        tl.store(o_ptr + (start + tok)[:, None] * stride_on + heads[:, None] * stride_oh + offs_v[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=r_ok[:, None] & (offs_v[None, :] < DV))

    return paged_prefill_kernel


def paged_prefill(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, block_table: torch.Tensor,
                  kv_lens: torch.Tensor, new_lens: torch.Tensor, starts: torch.Tensor, tiles: torch.Tensor,
                  scale: float, window: int | None = None) -> torch.Tensor:
    """Attention of a packed step's tokens through the block tables, prompt chunks and decode tokens alike, in one
    launch: ``query [N, H, D]`` holds sequence ``s``'s ``new_lens[s]`` tokens from row ``starts[s]`` on, at positions
    ``kv_lens[s] - new_lens[s]`` onward (their keys already written to the pools); each token sees its sequence's
    keys up to itself (the last ``window`` of them with a sliding window). ``tiles [T, 2]`` int32 on the device:
    :func:`prefill_tiles` of the host's ``new_lens``, so nothing is read back. Each program takes
    :data:`PREFILL_BQ` tokens of one sequence and one KV head's group (the rows of an MMA), walks the blocks up to
    its last token with an online softmax in fp32, and writes its rows of the ``[N, H, Dv]`` output (rows no tile
    covers are left unwritten). fp32 inputs multiply in full precision; fp16 and bf16 ones as tf32, exact for their
    products (their mantissas fit), the probabilities rounded to tf32 for the values' sum.

    Raises:
        ValueError: heads that are not a multiple of the KV heads, or a query that is not ``[N, H, D]``.
    """
    n, h, d, bs, h_kv, dv, g = _shapes("paged_prefill", "N", query, key_pool, value_pool)
    out = query.new_empty(n, h, dv)
    if tiles.shape[0]:
        table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
        kernel = _prefill_kernel()
        grid = (tiles.shape[0], h_kv)
        args = (query, key_pool, value_pool, out, table, kv_lens.contiguous(), new_lens.contiguous(),
                starts.contiguous(), tiles.contiguous(), float(scale), int(window or 0), query.stride(0),
                query.stride(1), out.stride(0), out.stride(1), key_pool.stride(0), key_pool.stride(1),
                key_pool.stride(2), value_pool.stride(0), value_pool.stride(1), value_pool.stride(2), table.stride(0))
        meta = {"G": g, "GP": _pow2(g), "BQ": PREFILL_BQ, "BS": bs, "BSP": _pow2(bs, 16), "D": d, "DP": _pow2(d, 16),
                "DV": dv, "DVP": _pow2(dv, 16), "PRECISION": "ieee" if query.dtype == torch.float32 else "tf32"}
        _launch(kernel, grid, args, meta, query)
    _CALLS["triton_prefill"] += 1
    return out


@torch.library.custom_op("infopt::paged_attention_triton", mutates_args=())
def paged_attention_triton(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                           block_table: torch.Tensor, query_start: torch.Tensor, kv_lens: torch.Tensor, scale: float,
                           window: int, tiles: torch.Tensor) -> torch.Tensor:
    """The Triton kernels as one operator with the C++ kernel's contract (``query [n, H, D]``: the step's tokens
    grouped by sequence, ``query_start [S + 1]``; returns ``[n, H, Dv]``), for a compiled forward on CUDA: a step of
    one token per sequence (``n == S``) runs :func:`paged_decode`, any other :func:`paged_prefill` over ``tiles``
    (its programs, made outside the graph). Nothing is read back to the host."""
    if query.shape[0] == block_table.shape[0]:
        return paged_decode(query, key_pool, value_pool, block_table, kv_lens, scale, window or None)
    new_lens = query_start[1:] - query_start[:-1]
    return paged_prefill(query, key_pool, value_pool, block_table, kv_lens, new_lens, query_start, tiles, scale,
                         window or None)


@paged_attention_triton.register_fake
def _(query, key_pool, value_pool, block_table, query_start, kv_lens, scale, window, tiles):
    return query.new_empty(query.shape[0], query.shape[1], value_pool.shape[-1])
