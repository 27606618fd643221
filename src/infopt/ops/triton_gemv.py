"""Triton kernels for weight-only linears at one to a few rows on CUDA (decode): a matrix-vector product per row that
reads each weight once, in its stored format, and converts it in registers.

Two formats:

- :func:`w8_gemv`: 8-bit weights ``[N, K]`` (int8 or float8_e4m3fn) with one scale per output channel:
  ``y = x @ (w * scale[:, None]).T``. Unlike :mod:`infopt.quantize.formats.fp8`'s ``torch._scaled_mm`` path the activations
  stay in their dtype (weight-only FP8), and unlike :mod:`infopt.ops.triton_int8` no 16-row ``tl.dot`` tile is
  padded around a single row.
- :func:`w4_gemv`: 4-bit codes packed two per byte ``[N, K // 2]`` (column ``2j`` in the low nibble, as
  :func:`infopt.quantize.formats.primitives.pack_int4` packs them) with a bf16 ``(scale, offset)`` pair per group of
  ``group_size`` input channels ``[N, K // group_size, 2]``: a weight is ``(code - 8) * scale + offset``, the
  values torch's CUDA int4 kernel (tinygemm) takes, so both compute with the same weights.

Why: on an H200, batch-1 decode of an 8B-parameter Llama (``benchmarks/gpu_decode.py --model llama-8b``) read
its int4 weights through tinygemm at 887 GB/s, a quarter of the measured copy bandwidth, so int4 decoded only 1.09x
faster than bf16 (the fourth GPU lane run, ``benchmarks/results/gpu/2026-11-26-h200-fourth-run.json``); FP8 through
``_scaled_mm`` at one row was slower than bf16 (128x128 tiles). A matrix-vector product has no reuse to exploit:
what counts is keeping enough weight bytes in flight, so each program streams ``BLOCK_N`` contiguous weight rows in
``BLOCK_K``-wide chunks, multiplies them with the activation row in fp32 and reduces along K; int4 chunks hold whole
groups, so each group's scale multiplies a partial sum (``s * sum(c * x) + (offset - 8 s) * sum(x)``), not every
weight.

**Measured on a GPU, and short of the mark for 4 bits.** On an H200, at one row on an 8B Llama's layers, the 8-bit
kernel unsplit read its weights at 35-85% of the device's copy bandwidth (cuBLAS bf16 63-89%), the 4-bit one at
17-36% (tinygemm 30-44%). Splitting K among programs (the seventh GPU lane run,
``benchmarks/results/gpu/2026-11-28-h200-seventh-run-gemv.json``) lifts the 8-bit kernel on the 4,096-output layers
from 35% to 50% (o) and 39% to 72% (down), the 4-bit one only to 23% and 30%: :func:`gemv_tiles` splits on sm_90
parts by that sweep. Batch-1 decode of the 8B model with FP8 weight-only layers: 1.08x ``gpu-fast`` in bf16 on the
swept tiles, 0.92x on the unsplit ones (same process). The kernels are checked here in Triton's CPU interpreter
(numerics against the references). They stay opt-in: nothing in infopt calls them by default.

Both are ``torch.library`` custom ops with fake implementations, so ``torch.compile`` traces each as one call and
CUDA graphs capture its launch. Without Triton, on a CPU (unless ``TRITON_INTERPRET=1``), or for an activation dtype
the kernel does not take, they compute their reference (dequantize, then ``F.linear``), warning once on CUDA.
"""

# no `from __future__ import annotations`: torch.library.custom_op reads the op's schema from real annotations

import functools
import math
import warnings

import torch
import torch.nn.functional as F

from .triton_int8 import MM_DTYPES, _bf16_dot_ok, _interpreting, triton_available

__all__ = ["w8_gemv", "w4_gemv", "w8_gemv_reference", "w4_gemv_reference", "w4_dequantize", "gemv_tiles",
           "set_gemv_tiles", "GEMV_MAX_ROWS", "kernel_calls", "W8_DTYPES"]

GEMV_MAX_ROWS = 8
"""Rows up to which the kernels are meant to run (each row re-reads the weight, from L2 when programs of one weight
block run together); more rows are a matrix product's job."""

W8_DTYPES = tuple(d for d in (torch.int8, getattr(torch, "float8_e4m3fn", None)) if d is not None)
"""Weight dtypes :func:`w8_gemv` takes."""

triton = tl = _finish = None  # bound by _kernels(), on the first launch
_CALLS = {"triton": 0, "reference": 0}
_WARNED = False


def kernel_calls() -> dict[str, int]:
    """Eager calls of :func:`w8_gemv` and :func:`w4_gemv` per path since import, as
    :func:`infopt.ops.triton_int8.kernel_calls` counts its op's (graph replays uncounted)."""
    return dict(_CALLS)


def w8_gemv_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T`` with the weight dequantized in fp32, the result in ``x.dtype``.

    Example:
        >>> w = torch.tensor([[1, -2], [3, 4]], dtype=torch.int8)
        >>> w8_gemv_reference(torch.ones(1, 2), w, torch.tensor([0.5, 1.0])).tolist()
        [[-0.5, 7.0]]
    """
    w = weight.float() * scale.float()[:, None]
    return F.linear(x.float(), w).to(x.dtype)


def w4_gemv_reference(x: torch.Tensor, qweight: torch.Tensor, scale_offset: torch.Tensor, group_size: int
                      ) -> torch.Tensor:
    """``x @ W.T`` with ``W = (code - 8) * scale + offset`` per group, dequantized in fp32, the result in ``x.dtype``.

    Example:
        >>> q = torch.tensor([[0x98]], dtype=torch.uint8)  # codes 8 (column 0) and 9 (column 1)
        >>> so = torch.tensor([[[1.0, 0.5]]], dtype=torch.bfloat16)  # one group of 2: scale 1, offset 0.5
        >>> w4_gemv_reference(torch.tensor([[1.0, 2.0]]), q, so, 2).tolist()
        [[3.5]]
    """
    return F.linear(x.float(), w4_dequantize(qweight, scale_offset, group_size, torch.float32)).to(x.dtype)


def w4_dequantize(qweight: torch.Tensor, scale_offset: torch.Tensor, group_size: int, dtype: torch.dtype
                  ) -> torch.Tensor:
    """The ``[N, K]`` weight ``(code - 8) * scale + offset`` of :func:`w4_gemv`'s operands, computed in ``dtype``.

    Example:
        >>> q = torch.tensor([[0x98]], dtype=torch.uint8)
        >>> so = torch.tensor([[[1.0, 0.5]]], dtype=torch.bfloat16)
        >>> w4_dequantize(q, so, 2, torch.float32).tolist()
        [[0.5, 1.5]]
    """
    so = scale_offset.to(dtype)
    codes = torch.stack((qweight & 0x0F, qweight >> 4), dim=-1).flatten(-2).to(dtype) - 8  # low nibble first
    n = codes.shape[0]
    return (codes.view(n, -1, group_size) * so[..., :1] + so[..., 1:]).view_as(codes)


def _use_triton(x: torch.Tensor, what: str) -> bool:
    global _WARNED
    if not (x.is_cuda or _interpreting()) or x.dtype not in MM_DTYPES:
        return False
    if x.is_cuda and x.dtype == torch.bfloat16 and not _bf16_dot_ok(x.device.index or 0):
        return False  # Triton's bf16 needs Ampere or newer
    if not triton_available():
        if not _WARNED:
            _WARNED = True
            warnings.warn(f"infopt {what}: Triton is not installed, so the weight is dequantized on every call "
                          "(more memory traffic than the kernel); pip install triton", RuntimeWarning, stacklevel=3)
        return False
    return True


@functools.cache
def _kernels():
    """Import Triton and build both kernels, once (module-level names, where Triton looks ``tl`` and the kernels'
    shared helper up)."""
    global triton, tl, _finish
    import triton
    import triton.language as tl

    @triton.jit
    def _finish(y, y_ptr, ws_ptr, cnt_ptr, N, stride_ym, offs_n, mask_n, SPLIT: tl.constexpr):
        # y: this program's fp32 sums for y[m, offs_n]. Whole (SPLIT 1): stored. Split along K: written to the
        # workspace ws [SPLIT, M, N], then a ticket on the (m, n block) counter; the last program to arrive adds the
        # SPLIT partials in slice order (deterministic, unlike accumulating with atomics), stores y and resets the
        # counter for the next call (or graph replay)
        pid_m = tl.program_id(0)
        if SPLIT == 1:
            tl.store(y_ptr + pid_m * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)
        else:
            rows = tl.num_programs(0)
            tl.store(ws_ptr + (tl.program_id(2) * rows + pid_m) * N + offs_n, y, mask=mask_n)
            counter = cnt_ptr + pid_m * tl.num_programs(1) + tl.program_id(1)
            ticket = tl.atomic_add(counter, 1)  # acq_rel: the partial above is visible to whoever is last
            if ticket == SPLIT - 1:
                total = tl.zeros_like(y)
                for s in tl.static_range(SPLIT):
                    total += tl.load(ws_ptr + (s * rows + pid_m) * N + offs_n, mask=mask_n, other=0.0,
                                     cache_modifier=".cg")
                tl.store(y_ptr + pid_m * stride_ym + offs_n, total.to(y_ptr.dtype.element_ty), mask=mask_n)
                tl.atomic_xchg(counter, 0)

    @triton.jit
    def w8_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr, N, stride_xm, stride_ym, K: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, KS: tl.constexpr):
        # program (m, nb, s): y[m, nb * BLOCK_N : (nb + 1) * BLOCK_N] over the K slice [s KS, (s + 1) KS) (see
        # _finish for SPLIT > 1); m varies fastest, so the programs of several rows on one weight block run together
        # and share it through L2
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        k0 = tl.program_id(2) * KS
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_n = offs_n < N
        w_ptrs = w_ptr + offs_n[:, None] * K + k0 + offs_k[None, :]  # [BLOCK_N, BLOCK_K], rows contiguous
        x_ptrs = x_ptr + pid_m * stride_xm + k0 + offs_k
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # reduced once, after the loop
        for kb in range(0, KS // BLOCK_K):
            if K % KS == 0:
                w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
                x = tl.load(x_ptrs)
            else:
                k_ok = offs_k < K - k0 - kb * BLOCK_K
                w = tl.load(w_ptrs, mask=mask_n[:, None] & k_ok[None, :], other=0.0)
                x = tl.load(x_ptrs, mask=k_ok, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        scale = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        y = tl.sum(acc, axis=1) * scale
        _finish(y, y_ptr, ws_ptr, cnt_ptr, N, stride_ym, offs_n, mask_n, SPLIT)

    @triton.jit
    def w4_gemv_kernel(x_ptr, q_ptr, so_ptr, y_ptr, ws_ptr, cnt_ptr, N, stride_xm, stride_ym, K: tl.constexpr,
                       GS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                       KS: tl.constexpr):
        # BLOCK_K (a multiple of GS) weights per row and step: BLOCK_K // 2 bytes, BLOCK_K // GS groups; program
        # (m, nb, s) over the K slice [s KS, (s + 1) KS), KS a multiple of BLOCK_K (see _finish for SPLIT > 1)
        HALF: tl.constexpr = BLOCK_K // 2
        NG: tl.constexpr = BLOCK_K // GS
        G: tl.constexpr = K // GS
        pid_m = tl.program_id(0)
        k0 = tl.program_id(2) * KS
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_j = tl.arange(0, HALF)
        offs_g = tl.arange(0, NG)
        mask_n = offs_n < N
        # [BLOCK_N, HALF] bytes, rows contiguous
        q_ptrs = q_ptr + offs_n[:, None] * (K // 2) + k0 // 2 + offs_j[None, :]
        x_ptrs = x_ptr + pid_m * stride_xm + k0 + 2 * offs_j  # even columns; odd ones at + 1
        # [BLOCK_N, NG] scales; offsets at + 1
        so_ptrs = so_ptr + offs_n[:, None] * (G * 2) + (k0 // GS) * 2 + offs_g[None, :] * 2
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for kb in range(0, KS // BLOCK_K):
            if K % KS == 0:
                b = tl.load(q_ptrs, mask=mask_n[:, None], other=0)
                xe = tl.load(x_ptrs).to(tl.float32)
                xo = tl.load(x_ptrs + 1).to(tl.float32)
                s = tl.load(so_ptrs, mask=mask_n[:, None], other=0.0).to(tl.float32)
                o = tl.load(so_ptrs + 1, mask=mask_n[:, None], other=0.0).to(tl.float32)
            else:  # a chunk past K (by whole groups) reads as zeros
                j_ok = offs_j < (K - k0 - kb * BLOCK_K) // 2
                g_ok = offs_g < (K - k0 - kb * BLOCK_K) // GS
                b = tl.load(q_ptrs, mask=mask_n[:, None] & j_ok[None, :], other=0)
                xe = tl.load(x_ptrs, mask=j_ok, other=0.0).to(tl.float32)
                xo = tl.load(x_ptrs + 1, mask=j_ok, other=0.0).to(tl.float32)
                s = tl.load(so_ptrs, mask=mask_n[:, None] & g_ok[None, :], other=0.0).to(tl.float32)
                o = tl.load(so_ptrs + 1, mask=mask_n[:, None] & g_ok[None, :], other=0.0).to(tl.float32)
            lo = (b & 0xF).to(tl.float32)  # code of column 2j
            hi = (b >> 4).to(tl.float32)  # code of column 2j + 1
            part = tl.sum(tl.reshape(lo * xe[None, :] + hi * xo[None, :], (BLOCK_N, NG, GS // 2)), axis=2)
            xsum = tl.sum(tl.reshape(xe + xo, (NG, GS // 2)), axis=1)  # [NG]: each group's sum of x
            # sum_k ((c - 8) s + o) x_k = s * sum(c x) + (o - 8 s) * sum(x), per group
            acc += tl.sum(s * part + (o - 8.0 * s) * xsum[None, :], axis=1)
            q_ptrs += HALF
            x_ptrs += BLOCK_K
            so_ptrs += NG * 2
        _finish(acc, y_ptr, ws_ptr, cnt_ptr, N, stride_ym, offs_n, mask_n, SPLIT)

    return w8_gemv_kernel, w4_gemv_kernel


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, v).bit_length() - 1)


_TUNED: dict[tuple[int, int, int, int | None], tuple[int, int, int, int, int]] = {}
"""Tiles set with :func:`set_gemv_tiles`, by ``(N, K, bits, group_size or None)``."""


def gemv_tiles(n: int, k: int, bits: int, group_size: int | None = None, sms: int | None = None
               ) -> tuple[int, int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, num_stages, split)`` for an ``[N, K]`` weight of ``bits`` (8 or 4) bits:
    the tiles :func:`set_gemv_tiles` set for that shape, else the rule below.

    Chunks of 256 bytes per weight row (``BLOCK_K`` 256 for 8-bit weights, 512 for 4-bit ones: a multiple of
    ``group_size``, whole groups per chunk), fewer for narrower layers; as many warps (at most 4) as leave each thread
    16 bytes of weight per load; 3 stages. Output rows per program and K split:

    - ``sms`` given (a Hopper part's streaming multiprocessors; what the kernels' launch passes on sm_90) and at
      least 16M weights (4096 x 4096; smaller layers as below): measured on an H200 (the seventh GPU lane run,
      ``benchmarks/gpu_gemv.py --sweep-kernels gemv_w8_split,gemv_w4_split`` on an 8B Llama's layers): 16 rows unsplit where that makes at least 4 programs per SM (gate/up), else 32 rows with K
      split among 2, 4 or 8 programs, the power of two nearest to 3 programs per SM (o and down: split 4, the fastest
      of the 12 tiles swept at one row, the 8-bit kernel from 35-41% of the copy bandwidth to 50-72%; q/k/v: 2);
    - otherwise (not measured): 16 rows where that leaves at least 128 programs per activation row (else 8, then 4),
      K not split.

    Example:
        >>> gemv_tiles(4096, 4096, 8), gemv_tiles(4096, 4096, 4, 128), gemv_tiles(576, 576, 4, 64)
        ((16, 256, 4, 3, 1), (16, 512, 4, 3, 1), (4, 512, 2, 3, 1))
        >>> gemv_tiles(4096, 4096, 8, sms=132), gemv_tiles(6144, 4096, 4, 64, sms=132)
        ((32, 256, 4, 3, 4), (32, 512, 4, 3, 2))
    """
    if bits == 4 and (group_size is None or group_size <= 1 or group_size & (group_size - 1) or k % group_size):
        raise ValueError(f"gemv_tiles: 4-bit weights need a power-of-two group_size dividing K={k}, got {group_size}")
    tuned = _TUNED.get((n, k, bits, group_size if bits == 4 else None))
    if tuned is not None:
        return tuned
    if bits == 8:
        block_k = min(256, max(16, 1 << (max(1, k) - 1).bit_length()))
    else:  # at least one group, at most 512 weights unless a group is longer, no more than K needs
        block_k = max(group_size, min(512, 1 << (k - 1).bit_length()))
    split = 1
    if sms and n * k >= 1 << 24:
        block_n = 16 if -(-n // 16) >= 4 * sms else 32
        if block_n == 32:
            want = 3 * sms / -(-n // 32)  # programs per output block for about 3 per SM
            split = min(8, max(1, 1 << max(0, round(math.log2(want))))) if want > 1 else 1
            split = min(split, _pow2_floor(k // block_k))  # at least one chunk per program
    else:
        block_n = next((b for b in (16, 8) if -(-n // b) >= 128), 4)
    row_bytes = block_k * bits // 8
    warps = max(1, min(4, block_n * row_bytes // (32 * 16)))
    return block_n, block_k, warps, 3, split


@functools.cache
def _hopper_sms(index: int) -> int | None:
    """Streaming multiprocessors of CUDA device ``index`` if it is an sm_90 part (where the split-K rule of
    :func:`gemv_tiles` was measured), else None."""
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count if (props.major, props.minor) == (9, 0) else None


def _sms(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return _hopper_sms(device.index if device.index is not None else torch.cuda.current_device())


def set_gemv_tiles(n: int, k: int, bits: int, tiles: tuple[int, ...] | None, group_size: int | None = None) -> None:
    """Launch every product on an ``[n, k]`` weight of ``bits`` bits (4-bit: of ``group_size``) with ``tiles``
    ``(BLOCK_N, BLOCK_K, num_warps, num_stages[, split])`` from now on, or with ``tiles=None`` by the table again:
    for tiles measured on a device (``benchmarks/gpu_gemv.py --sweep``). Steps already captured in a CUDA graph keep
    the tiles they were captured with.

    Raises:
        ValueError: ``bits`` not 4 or 8; tiles that are not 4 or 5 positive ints, a ``BLOCK_N`` or ``BLOCK_K`` that is
            not a power of two (``tl.arange`` takes those only), a 4-bit ``BLOCK_K`` that is not a whole number of
            groups.

    Example:
        >>> set_gemv_tiles(4096, 4096, 8, (8, 256, 4, 3, 4)); gemv_tiles(4096, 4096, 8)
        (8, 256, 4, 3, 4)
        >>> set_gemv_tiles(4096, 4096, 8, None); gemv_tiles(4096, 4096, 8)
        (16, 256, 4, 3, 1)
    """
    if bits not in (4, 8):
        raise ValueError(f"set_gemv_tiles: bits={bits}; allowed: 8 (w8_gemv) or 4 (w4_gemv)")
    gemv_tiles(n, k, bits, group_size)  # the group size's own check
    key = (n, k, bits, group_size if bits == 4 else None)
    if tiles is None:
        _TUNED.pop(key, None)
        return
    tiles = tuple(tiles)
    if (len(tiles) not in (4, 5) or not all(isinstance(t, int) and t > 0 for t in tiles)
            or any(b & (b - 1) for b in tiles[:2]) or (bits == 4 and tiles[1] % group_size)):
        raise ValueError(f"set_gemv_tiles: tiles {tiles}; allowed: (BLOCK_N, BLOCK_K, num_warps, num_stages[, split]) "
                         "of positive ints, BLOCK_N and BLOCK_K powers of two"
                         + (f", BLOCK_K a multiple of group_size={group_size}" if bits == 4 else ""))
    _TUNED[key] = (*tiles, 1)[:5]


def _check_rows(x: torch.Tensor, k: int, what: str) -> torch.Tensor:
    if x.shape[-1] != k:
        raise ValueError(f"{what}: x {tuple(x.shape)} does not end in the weight's K={k}")
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


_COUNTERS: dict[torch.device, torch.Tensor] = {}  # the split-K tickets per device, zero between calls


def _counters(device: torch.device, size: int) -> torch.Tensor:
    """``size`` zeroed int32 split-K counters on ``device``: one buffer per device kept across calls (each call's
    last program resets what it used), grown outside CUDA-graph capture; during a capture that needs more, a
    zeroed buffer of the call's own (its zeroing is captured with it)."""
    have = _COUNTERS.get(device)
    if have is not None and have.numel() >= size:
        return have
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(size, dtype=torch.int32, device=device)
    _COUNTERS[device] = buf = torch.zeros(max(size, 4096), dtype=torch.int32, device=device)
    return buf


def _launch_split(kernel, x2: torch.Tensor, n: int, k: int, bn: int, bk: int, split: int, args: tuple, meta: dict
                  ) -> torch.Tensor:
    """Launch ``kernel`` over ``(M, N blocks, split)`` programs, each over a slice of K in whole ``bk`` chunks,
    with the split-K workspace and counters it needs; returns ``y [M, n]``."""
    y = torch.empty(x2.shape[0], n, dtype=x2.dtype, device=x2.device)
    if not y.numel():
        return y
    split = max(1, min(split, -(-k // bk)))
    ks = ((k + split - 1) // split + bk - 1) // bk * bk  # each program's K slice: whole BLOCK_K chunks
    ws = cnt = y
    if split > 1:
        ws = torch.empty(split, x2.shape[0], n, dtype=torch.float32, device=x2.device)
        cnt = _counters(x2.device, x2.shape[0] * -(-n // bn))
    grid = (x2.shape[0], -(-n // bn), split)
    full = (x2, *args, y, ws, cnt, n, x2.stride(0), y.stride(0))
    meta = {**meta, "K": k, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT": split, "KS": ks}
    if x2.is_cuda:
        with torch.cuda.device(x2.device):  # Triton launches on the current device
            kernel[grid](*full, **meta)
    else:  # TRITON_INTERPRET=1 on CPU tensors
        kernel[grid](*full, **meta)
    return y


def launch_w8(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              tiles: tuple[int, ...] | None = None) -> torch.Tensor:
    """Run the 8-bit kernel on checked operands (``x2 [M, K]`` with unit column stride): what :func:`w8_gemv` calls,
    and ``benchmarks/gpu_gemv.py`` with its own ``tiles`` (``(BLOCK_N, BLOCK_K, num_warps, num_stages[, split])``:
    ``split`` > 1 divides K among that many programs per output block, whose partial sums one of them adds in a
    fixed order: :func:`gemv_tiles` chooses it on sm_90 parts, :func:`set_gemv_tiles` anywhere)."""
    n, k = weight.shape
    bn, bk, warps, stages, *rest = tiles or gemv_tiles(n, k, 8, sms=_sms(x2.device))
    return _launch_split(_kernels()[0], x2, n, k, bn, bk, rest[0] if rest else 1, (weight, scale),
                         {"num_warps": warps, "num_stages": stages})


def launch_w4(x2: torch.Tensor, qweight: torch.Tensor, scale_offset: torch.Tensor, group_size: int,
              tiles: tuple[int, ...] | None = None) -> torch.Tensor:
    """The 4-bit kernel's counterpart of :func:`launch_w8` (``BLOCK_K`` a multiple of ``group_size`` dividing K; the
    same optional ``split``)."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    bn, bk, warps, stages, *rest = tiles or gemv_tiles(n, k, 4, group_size, sms=_sms(x2.device))
    return _launch_split(_kernels()[1], x2, n, k, bn, bk, rest[0] if rest else 1, (qweight, scale_offset),
                         {"GS": group_size, "num_warps": warps, "num_stages": stages})


@torch.library.custom_op("infopt::w8_gemv", mutates_args=())
def w8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T`` reading the 8-bit weight once (the Triton kernel on CUDA).

    Args:
        x: ``[..., K]`` activations, bfloat16, float16 or float32 (meant for up to :data:`GEMV_MAX_ROWS` rows).
        weight: ``[N, K]`` int8 or float8_e4m3fn, contiguous.
        scale: ``[N]`` float, one per output channel.

    Returns:
        ``[..., N]`` in ``x.dtype``, accumulated in fp32.

    Raises:
        ValueError: mismatched shapes, a weight dtype outside :data:`W8_DTYPES`.

    Example:
        >>> w = torch.tensor([[1, -2], [3, 4]], dtype=torch.int8)
        >>> w8_gemv(torch.ones(1, 2), w, torch.tensor([0.5, 1.0])).tolist()
        [[-0.5, 7.0]]
    """
    if weight.dtype not in W8_DTYPES or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"w8_gemv: weight {tuple(weight.shape)} {weight.dtype}; allowed: a contiguous [N, K] of "
                         f"{', '.join(map(str, W8_DTYPES))}")
    n, k = weight.shape
    if scale.shape != (n,) or not scale.dtype.is_floating_point:
        raise ValueError(f"w8_gemv: scale {tuple(scale.shape)} {scale.dtype}; allowed: a floating-point [{n}]")
    x2 = _check_rows(x, k, "w8_gemv")
    if not _use_triton(x2, "w8_gemv"):
        _CALLS["reference"] += 1
        return w8_gemv_reference(x2, weight, scale).reshape(*x.shape[:-1], n)
    _CALLS["triton"] += 1
    return launch_w8(x2, weight, scale).reshape(*x.shape[:-1], n)


@w8_gemv.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("infopt::w4_gemv", mutates_args=())
def w4_gemv(x: torch.Tensor, qweight: torch.Tensor, scale_offset: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x @ W.T`` with ``W = (code - 8) * scale + offset`` per group, reading the packed 4-bit codes once (the Triton
    kernel on CUDA).

    Args:
        x: ``[..., K]`` activations, bfloat16, float16 or float32 (meant for up to :data:`GEMV_MAX_ROWS` rows).
        qweight: uint8 ``[N, K // 2]``, contiguous: column ``2j`` in the low nibble, ``2j + 1`` in the high one.
        scale_offset: ``[N, K // group_size, 2]`` (bf16 in the CUDA layout; any float dtype is read as it is).
        group_size: input channels per group, a power of two dividing ``K``.

    Returns:
        ``[..., N]`` in ``x.dtype``, accumulated in fp32.

    Raises:
        ValueError: mismatched shapes or dtypes, a group size that is not a power of two dividing ``K``.

    Example:
        >>> q = torch.tensor([[0x98]], dtype=torch.uint8)
        >>> so = torch.tensor([[[1.0, 0.5]]], dtype=torch.bfloat16)
        >>> w4_gemv(torch.tensor([[1.0, 2.0]]), q, so, 2).tolist()
        [[3.5]]
    """
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or not qweight.is_contiguous():
        raise ValueError(f"w4_gemv: qweight {tuple(qweight.shape)} {qweight.dtype}; allowed: a contiguous uint8 "
                         "[N, K // 2]")
    n, k = qweight.shape[0], qweight.shape[1] * 2
    if group_size <= 0 or group_size & (group_size - 1) or k % group_size:
        raise ValueError(f"w4_gemv: group_size {group_size}; allowed: a power of two dividing K={k}")
    if (scale_offset.shape != (n, k // group_size, 2) or not scale_offset.dtype.is_floating_point
            or not scale_offset.is_contiguous()):
        raise ValueError(f"w4_gemv: scale_offset {tuple(scale_offset.shape)} {scale_offset.dtype}; allowed: a "
                         f"contiguous floating-point [{n}, {k // group_size}, 2]")
    x2 = _check_rows(x, k, "w4_gemv")
    if not _use_triton(x2, "w4_gemv") or group_size < 2:  # a group of one has no byte of its own
        _CALLS["reference"] += 1
        return w4_gemv_reference(x2, qweight, scale_offset, group_size).reshape(*x.shape[:-1], n)
    _CALLS["triton"] += 1
    return launch_w4(x2, qweight, scale_offset, group_size).reshape(*x.shape[:-1], n)


@w4_gemv.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor, scale_offset: torch.Tensor, group_size: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))
