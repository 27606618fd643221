"""Triton kernels for weight-only linears at one to a few rows on CUDA (decode): a matrix-vector product per row that
reads each weight once, in its stored format, and converts it in registers.

Two formats:

- :func:`w8_gemv`: 8-bit weights ``[N, K]`` (int8 or float8_e4m3fn) with one scale per output channel:
  ``y = x @ (w * scale[:, None]).T``. Unlike :mod:`infopt.quantize.fp8`'s ``torch._scaled_mm`` path the activations
  stay in their dtype (weight-only FP8), and unlike :mod:`infopt.quantize.triton_int8` no 16-row ``tl.dot`` tile is
  padded around a single row.
- :func:`w4_gemv`: 4-bit codes packed two per byte ``[N, K // 2]`` (column ``2j`` in the low nibble, as
  :func:`infopt.quantize.primitives.pack_int4` packs them) with a bf16 ``(scale, offset)`` pair per group of
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

**Measured once on a GPU, and short of the mark.** On an H200 (the fifth GPU lane run,
``benchmarks/results/gpu/2026-11-27-h200-fifth-run.json``), at one row on an 8B Llama's q/k/v and o layers, the
8-bit kernel read its weights at 30-50% of the device's copy bandwidth (fp8 35-50%, int8 30-44%; cuBLAS bf16 59-75%)
and the 4-bit one at 17-23% (tinygemm 31-34%); batch-1 decode of the 8B model: FP8 weight-only 1.015x ``gpu-fast``
in bf16, int4 0.92x (tinygemm 1.21x). The tile table below was never swept on a device (``benchmarks/gpu_gemv.py
--sweep``). The kernels are checked here in Triton's CPU interpreter (numerics against the references). They stay
opt-in: nothing in infopt calls them by default.

Both are ``torch.library`` custom ops with fake implementations, so ``torch.compile`` traces each as one call and
CUDA graphs capture its launch. Without Triton, on a CPU (unless ``TRITON_INTERPRET=1``), or for an activation dtype
the kernel does not take, they compute their reference (dequantize, then ``F.linear``), warning once on CUDA.
"""

# no `from __future__ import annotations`: torch.library.custom_op reads the op's schema from real annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from .primitives import pack_int4, unpack_int4
from .triton_int8 import MM_DTYPES, _bf16_dot_ok, _interpreting, triton_available

__all__ = ["w8_gemv", "w4_gemv", "w8_gemv_reference", "w4_gemv_reference", "w4_dequantize", "gemv_tiles", "GEMV_MAX_ROWS",
           "kernel_calls", "W8_DTYPES"]

GEMV_MAX_ROWS = 8
"""Rows up to which the kernels are meant to run (each row re-reads the weight, from L2 when programs of one weight
block run together); more rows are a matrix product's job."""

W8_DTYPES = tuple(d for d in (torch.int8, getattr(torch, "float8_e4m3fn", None)) if d is not None)
"""Weight dtypes :func:`w8_gemv` takes."""

triton = tl = _split4 = _plane = None  # bound by _kernels(), on the first launch
_CALLS = {"triton": 0, "reference": 0}
_WARNED = False


def kernel_calls() -> dict[str, int]:
    """Eager calls of :func:`w8_gemv` and :func:`w4_gemv` per path since import, as
    :func:`infopt.quantize.triton_int8.kernel_calls` counts its op's (graph replays uncounted)."""
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
    codes = (deinterleave_int4(qweight) if qweight.dtype == torch.int32 else unpack_int4(qweight)).to(dtype) - 8
    n = codes.shape[0]
    return (codes.view(n, -1, group_size) * so[..., :1] + so[..., 1:]).view_as(codes)


INTERLEAVE = 256
"""Columns per block of :func:`interleave_int4`'s order."""


def interleave_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes ``[N, K]`` (0..15) into int32 words ``[N, K // 8]`` in the order the interleaved 4-bit kernel
    reads: within each block of 256 columns, nibble ``i`` (bits ``4i..4i+3``) of word ``j`` holds column
    ``32 i + j``, so each of a word's eight nibbles meets a different run of 32 contiguous activations.

    Example:
        >>> c = torch.arange(256).remainder(16).view(1, 256)  # column 32 i + j holds (32 i + j) % 16 = j % 16
        >>> hex(interleave_int4(c)[0, 3].item() & 0xFFFFFFFF)  # word 3: column 3, 35, 67, ... all code 3
        '0x33333333'
        >>> torch.equal(deinterleave_int4(interleave_int4(c)), c.to(torch.uint8))
        True
    """
    n, k = codes.shape
    if k % INTERLEAVE:
        raise ValueError(f"interleave_int4: K={k} is not a multiple of {INTERLEAVE}")
    c = codes.to(torch.uint8).reshape(n, k // INTERLEAVE, 8, 32).transpose(2, 3)  # [.., j, i]
    return pack_int4(c.reshape(n, k)).view(torch.int32)


def deinterleave_int4(words: torch.Tensor) -> torch.Tensor:
    """The codes ``[N, K]`` (uint8) of :func:`interleave_int4`'s words ``[N, K // 8]``."""
    n, k = words.shape[0], words.shape[1] * 8
    c = unpack_int4(words.contiguous().view(torch.uint8)).reshape(n, k // INTERLEAVE, 32, 8).transpose(2, 3)
    return c.reshape(n, k).contiguous()


def interleaved_ok(k: int, group_size: int) -> bool:
    """Whether an ``[N, K]`` weight in groups of ``group_size`` can take the interleaved 4-bit kernel: K a multiple
    of 256 and groups of 32 to 256 columns (whole 32-column planes within one 256-column block)."""
    return k % INTERLEAVE == 0 and group_size in (32, 64, 128, 256)


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
    """Import Triton and build the kernels, once (module-level names, where Triton looks ``tl`` and the kernels'
    helpers up)."""
    global triton, tl, _split4, _plane
    import triton
    import triton.language as tl

    @triton.jit
    def w8_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, stride_xm, stride_ym, K: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # program (m, nb): y[m, nb * BLOCK_N : (nb + 1) * BLOCK_N]; m varies fastest, so the programs of several rows
        # on one weight block run together and share it through L2
        pid_m = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_n = offs_n < N
        w_ptrs = w_ptr + offs_n[:, None] * K + offs_k[None, :]  # [BLOCK_N, BLOCK_K], rows contiguous
        x_ptrs = x_ptr + pid_m * stride_xm + offs_k
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # reduced once, after the loop
        for kb in range(0, (K + BLOCK_K - 1) // BLOCK_K):
            if K % BLOCK_K == 0:
                w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
                x = tl.load(x_ptrs)
            else:
                k_ok = offs_k < K - kb * BLOCK_K
                w = tl.load(w_ptrs, mask=mask_n[:, None] & k_ok[None, :], other=0.0)
                x = tl.load(x_ptrs, mask=k_ok, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        scale = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        y = tl.sum(acc, axis=1) * scale
        tl.store(y_ptr + pid_m * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)

    @triton.jit
    def w4_gemv_kernel(x_ptr, q_ptr, so_ptr, y_ptr, N, stride_xm, stride_ym, K: tl.constexpr, GS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # BLOCK_K (a multiple of GS) weights per row and step: BLOCK_K // 2 bytes, BLOCK_K // GS groups
        HALF: tl.constexpr = BLOCK_K // 2
        NG: tl.constexpr = BLOCK_K // GS
        G: tl.constexpr = K // GS
        pid_m = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_j = tl.arange(0, HALF)
        offs_g = tl.arange(0, NG)
        mask_n = offs_n < N
        q_ptrs = q_ptr + offs_n[:, None] * (K // 2) + offs_j[None, :]  # [BLOCK_N, HALF] bytes, rows contiguous
        x_ptrs = x_ptr + pid_m * stride_xm + 2 * offs_j  # even columns; odd ones at + 1
        so_ptrs = so_ptr + offs_n[:, None] * (G * 2) + offs_g[None, :] * 2  # [BLOCK_N, NG] scales; offsets at + 1
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for kb in range(0, (K + BLOCK_K - 1) // BLOCK_K):
            if K % BLOCK_K == 0:
                b = tl.load(q_ptrs, mask=mask_n[:, None], other=0)
                xe = tl.load(x_ptrs).to(tl.float32)
                xo = tl.load(x_ptrs + 1).to(tl.float32)
                s = tl.load(so_ptrs, mask=mask_n[:, None], other=0.0).to(tl.float32)
                o = tl.load(so_ptrs + 1, mask=mask_n[:, None], other=0.0).to(tl.float32)
            else:  # the last chunk runs past K by whole groups: they read as zeros
                j_ok = offs_j < (K - kb * BLOCK_K) // 2
                g_ok = offs_g < (K - kb * BLOCK_K) // GS
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
        tl.store(y_ptr + pid_m * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)

    @triton.jit
    def _split4(v):
        # [..., 4] held in one thread -> its four [...] slices
        a, b = tl.split(tl.reshape(v, v.shape[:-1] + [2, 2]))
        a0, a1 = tl.split(a)
        b0, b1 = tl.split(b)
        return a0, b0, a1, b1

    @triton.jit
    def _plane(w, x, acc, i: tl.constexpr):
        # acc + code_i * x, code_i the nibble i of the words w: masked in place (bits 4e..4e+3; nibbles 5-7 shifted
        # down by 12 bits first, e = i - 3) and or-ed into the exponent of 2^(23 - 4e), it reads as
        # 2^(23 - 4e) + code exactly, and one subtraction leaves the code
        if i < 5:
            bits = (w & (15 << (4 * i))) | ((127 + 23 - 4 * i) << 23)
            code = bits.to(tl.float32, bitcast=True) - (1 << (23 - 4 * i)) * 1.0
        else:
            bits = ((w >> 12) & (15 << (4 * (i - 3)))) | ((127 + 23 - 4 * (i - 3)) << 23)
            code = bits.to(tl.float32, bitcast=True) - (1 << (23 - 4 * (i - 3))) * 1.0
        return tl.fma(code, x[None, :, :], acc)

    @triton.jit
    def w4i_gemv_kernel(x_ptr, q_ptr, so_ptr, y_ptr, N, stride_xm, stride_ym, K: tl.constexpr, GS: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr, PREFETCH: tl.constexpr):
        # q: int32 [N, K // 8] in the interleaved order (see interleave_int4): per 256 columns, word j's nibble i is
        # column 32 i + j, so plane i of a block (nibble i of its 32 words) meets 32 contiguous activations, and a
        # group (GS // 32 planes, 32 <= GS <= 256) has one (scale, offset) pair per row. A step takes BLOCKS blocks
        # as [BLOCK_N, BLOCKS, 8, 4] words: each thread's four words of a row are one 16-byte load and their products
        # sum in the thread. A nibble becomes a float without a conversion instruction: masked in place (bits
        # 4e..4e+3) and or-ed into the exponent of 2^(23 - 4e), it reads as 2^(23 - 4e) + code exactly; one
        # subtraction leaves the code. Nibbles 5-7 are shifted down by 12 bits first (e = i - 3). With PREFETCH the
        # next step's words are loaded before this step's arithmetic (Triton's pipeliner leaves loads that feed no
        # tl.dot alone).
        KW: tl.constexpr = K // 8
        G: tl.constexpr = K // GS
        PPG: tl.constexpr = GS // 32
        NB: tl.constexpr = K // 256
        pid_m = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_b = tl.arange(0, BLOCKS)
        offs_t = tl.arange(0, 8)
        offs_w = offs_t[:, None] * 4 + tl.arange(0, 4)[None, :]  # [8, 4]: word j = 4 t + u
        mask_n = offs_n < N
        mask_q = mask_n[:, None, None, None]
        # [BLOCK_N, BLOCKS, 8, 4]: 128 bytes of a row per block
        q_ptrs = q_ptr + offs_n[:, None, None, None] * KW + offs_b[None, :, None, None] * 32 + offs_w[None, None, :, :]
        x_ptrs = x_ptr + pid_m * stride_xm + offs_b[:, None, None] * 256 + offs_w[None, :, :]  # [BLOCKS, 8, 4]
        # [BLOCK_N, BLOCKS, 8] (the shape the products reduce to, so no layout change): each row's (scale, offset)
        # bf16 pair of a block's group as one 32-bit word
        so_ptrs = so_ptr + offs_n[:, None, None] * G + offs_b[None, :, None] * (256 // GS) + 0 * offs_t[None, None, :]
        so_mask = mask_n[:, None, None] & (offs_t[None, None, :] < 8)
        acc = tl.zeros((BLOCK_N, BLOCKS, 8), dtype=tl.float32)  # reduced across threads once, after the loop
        if PREFETCH:
            w_next = tl.load(q_ptrs, mask=mask_q, other=0)
        for b in range(0, NB, BLOCKS):
            if PREFETCH:
                w = w_next
                q_ptrs += 32 * BLOCKS
                w_next = tl.load(q_ptrs, mask=mask_q & (b + BLOCKS < NB), other=0)
            else:
                w = tl.load(q_ptrs, mask=mask_q, other=0)
                q_ptrs += 32 * BLOCKS
            # a thread's four words of a row, split apart (they sit in its registers): each plane's products then
            # chain into one accumulator per row, block and thread
            w0, w1, w2, w3 = _split4(w)
            for g in tl.static_range(8 // PPG):
                pair = tl.load(so_ptrs + g, mask=so_mask, other=0)
                s = (pair << 16).to(tl.float32, bitcast=True)  # the low bf16: the scale
                o = (pair & -65536).to(tl.float32, bitcast=True)  # the high one: the offset
                part = tl.zeros((BLOCK_N, BLOCKS, 8), dtype=tl.float32)
                xg = tl.zeros((BLOCKS, 8), dtype=tl.float32)
                for p in tl.static_range(PPG):
                    x0, x1, x2, x3 = _split4(tl.load(x_ptrs + (g * PPG + p) * 32).to(tl.float32))  # [BLOCKS, 8]
                    xg += (x0 + x1) + (x2 + x3)
                    part = _plane(w0, x0, part, g * PPG + p)
                    part = _plane(w1, x1, part, g * PPG + p)
                    part = _plane(w2, x2, part, g * PPG + p)
                    part = _plane(w3, x3, part, g * PPG + p)
                # sum_k ((c - 8) s + o) x_k = s * sum(c x) + (o - 8 s) * sum(x), per group, within the thread
                acc += part * s + xg[None, :, :] * (o - 8.0 * s)
            so_ptrs += (256 // GS) * BLOCKS
            x_ptrs += 256 * BLOCKS
        y = tl.sum(tl.sum(acc, axis=2), axis=1)
        tl.store(y_ptr + pid_m * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)

    return w8_gemv_kernel, w4_gemv_kernel, w4i_gemv_kernel


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, v).bit_length() - 1)


def gemv_tiles(n: int, k: int, bits: int, group_size: int | None = None) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` for an ``[N, K]`` weight of ``bits`` (8 or 4) bits.

    A first table, not yet tuned on a GPU: 16 weight rows per program where that leaves at least 128 programs
    per activation row (else 8, then 4); chunks of 256 bytes per weight row (``BLOCK_K`` 256 for 8-bit weights, 512
    for 4-bit ones: a multiple of ``group_size``, whole groups per chunk), fewer for narrower layers; as many warps
    (at most 4) as leave each thread 16 bytes of weight per load; 3 stages.

    Example:
        >>> gemv_tiles(4096, 4096, 8), gemv_tiles(4096, 4096, 4, 128), gemv_tiles(576, 576, 4, 64)
        ((16, 256, 4, 3), (16, 512, 4, 3), (4, 512, 2, 3))
    """
    if bits == 4 and (group_size is None or group_size <= 1 or group_size & (group_size - 1) or k % group_size):
        raise ValueError(f"gemv_tiles: 4-bit weights need a power-of-two group_size dividing K={k}, got {group_size}")
    block_n = next((b for b in (16, 8) if -(-n // b) >= 128), 4)
    if bits == 8:
        block_k = min(256, max(16, 1 << (max(1, k) - 1).bit_length()))
    else:  # at least one group, at most 512 weights unless a group is longer, no more than K needs
        block_k = max(group_size, min(512, 1 << (k - 1).bit_length()))
    row_bytes = block_k * bits // 8
    warps = max(1, min(4, block_n * row_bytes // (32 * 16)))
    return block_n, block_k, warps, 3


def _check_rows(x: torch.Tensor, k: int, what: str) -> torch.Tensor:
    if x.shape[-1] != k:
        raise ValueError(f"{what}: x {tuple(x.shape)} does not end in the weight's K={k}")
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(kernel, grid_n: int, x2: torch.Tensor, args: tuple, meta: dict) -> None:
    grid = (x2.shape[0], grid_n)
    if x2.is_cuda:
        with torch.cuda.device(x2.device):  # Triton launches on the current device
            kernel[grid](*args, **meta)
    else:  # TRITON_INTERPRET=1 on CPU tensors
        kernel[grid](*args, **meta)


def launch_w8(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Run the 8-bit kernel on checked operands (``x2 [M, K]`` with unit column stride): what :func:`w8_gemv` calls,
    and ``benchmarks/gpu_gemv.py`` with its own ``tiles`` (``(BLOCK_N, BLOCK_K, num_warps, num_stages)``)."""
    n, k = weight.shape
    y = torch.empty(x2.shape[0], n, dtype=x2.dtype, device=x2.device)
    if y.numel():
        bn, bk, warps, stages = tiles or gemv_tiles(n, k, 8)
        _launch(_kernels()[0], -(-n // bn), x2, (x2, weight, scale, y, n, x2.stride(0), y.stride(0)),
                {"K": k, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages})
    return y


def launch_w4(x2: torch.Tensor, qweight: torch.Tensor, scale_offset: torch.Tensor, group_size: int,
              tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """The 4-bit kernel's counterpart of :func:`launch_w8` (``BLOCK_K`` a multiple of ``group_size`` dividing K)."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    y = torch.empty(x2.shape[0], n, dtype=x2.dtype, device=x2.device)
    if y.numel():
        bn, bk, warps, stages = tiles or gemv_tiles(n, k, 4, group_size)
        _launch(_kernels()[1], -(-n // bn), x2, (x2, qweight, scale_offset, y, n, x2.stride(0), y.stride(0)),
                {"K": k, "GS": group_size, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages})
    return y


_TUNED: dict[tuple[int, int], tuple[int, int, int, int]] = {}


def tune_interleaved(sweep: str | dict | list) -> dict[tuple[int, int], tuple[int, int, int, int]]:
    """Take the interleaved 4-bit kernel's tiles per weight shape from a sweep ``benchmarks/gpu_gemv.py --sweep``
    measured on this kind of GPU: the fastest one-row configuration of ``gemv_int4i`` for each ``(N, K)`` there
    (other shapes keep :func:`gemv_tiles_interleaved`'s choice). ``sweep`` is the benchmark's JSON file, its
    document, or its ``sweep`` rows. Returns the table now in use (shape -> tiles). Call it before a step is
    compiled: a traced graph keeps the tiles it was traced with."""
    import json

    if isinstance(sweep, str):
        with open(sweep) as f:
            sweep = json.load(f)
    rows = sweep.get("sweep", []) if isinstance(sweep, dict) else sweep
    best: dict[tuple[int, int], dict] = {}
    for r in rows:
        if r.get("kernel") == "gemv_int4i" and r.get("rows") == 1 and "gbs" in r and len(r.get("tiles", ())) == 4:
            key = (int(r["n"]), int(r["k"]))
            if key not in best or r["gbs"] > best[key]["gbs"]:
                best[key] = r
    _TUNED.update({key: tuple(int(v) for v in r["tiles"]) for key, r in best.items()})
    return dict(_TUNED)


def gemv_tiles_interleaved(n: int, k: int) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCKS, PREFETCH, num_warps)`` for the interleaved 4-bit kernel on an ``[n, k]`` weight: the
    tiles :func:`tune_interleaved` took for the shape, else a first choice not yet measured on a GPU: four rows
    per thread where that leaves at least 128 programs per activation row, else fewer; two 256-column blocks per
    step where K has an even number of them; the next step's words loaded ahead.

    Example:
        >>> gemv_tiles_interleaved(4096, 4096), gemv_tiles_interleaved(576, 1536)
        ((32, 2, 1, 2), (4, 2, 1, 1))
    """
    tuned = _TUNED.get((n, k))
    if tuned is not None:
        return tuned
    block_n = next((b for b in (32, 16, 8) if -(-n // b) >= 128), 4)
    return block_n, 2 if (k // 256) % 2 == 0 else 1, 1, max(1, block_n // 16)


def launch_w4i(x2: torch.Tensor, words: torch.Tensor, scale_offset: torch.Tensor, group_size: int,
               tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Run the interleaved 4-bit kernel on checked operands: ``words`` int32 ``[N, K // 8]`` from
    :func:`interleave_int4`, ``scale_offset`` bf16 ``[N, K // group_size, 2]``; ``tiles`` as
    :func:`gemv_tiles_interleaved` gives them."""
    n, k = words.shape[0], words.shape[1] * 8
    y = torch.empty(x2.shape[0], n, dtype=x2.dtype, device=x2.device)
    if y.numel():
        bn, blocks, prefetch, warps = tiles or gemv_tiles_interleaved(n, k)
        if (k // INTERLEAVE) % blocks:
            raise ValueError(f"launch_w4i: BLOCKS={blocks} does not divide the {k // INTERLEAVE} blocks of K={k}")
        pairs = scale_offset.view(torch.int32).reshape(n, k // group_size)  # each (scale, offset) bf16 pair
        _launch(_kernels()[2], -(-n // bn), x2, (x2, words, pairs, y, n, x2.stride(0), y.stride(0)),
                {"K": k, "GS": group_size, "BLOCK_N": bn, "BLOCKS": blocks, "PREFETCH": bool(prefetch),
                 "num_warps": warps, "num_stages": 1})
    return y


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
        qweight: uint8 ``[N, K // 2]``, contiguous: column ``2j`` in the low nibble, ``2j + 1`` in the high one; or
            int32 ``[N, K // 8]`` words in :func:`interleave_int4`'s order (K a multiple of 256, groups of 32 to
            256), which the faster interleaved kernel reads.
        scale_offset: ``[N, K // group_size, 2]`` (bf16 in the CUDA layout, and for int32 words; any float dtype
            is read as it is with uint8 codes).
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
    words = qweight.dtype == torch.int32
    if qweight.dtype not in (torch.uint8, torch.int32) or qweight.dim() != 2 or not qweight.is_contiguous():
        raise ValueError(f"w4_gemv: qweight {tuple(qweight.shape)} {qweight.dtype}; allowed: a contiguous uint8 "
                         "[N, K // 2] or int32 [N, K // 8] (interleave_int4)")
    n, k = qweight.shape[0], qweight.shape[1] * (8 if words else 2)
    if group_size <= 0 or group_size & (group_size - 1) or k % group_size:
        raise ValueError(f"w4_gemv: group_size {group_size}; allowed: a power of two dividing K={k}")
    if words and (not interleaved_ok(k, group_size) or scale_offset.dtype != torch.bfloat16):
        raise ValueError(f"w4_gemv: interleaved int32 words need K a multiple of {INTERLEAVE}, a group_size of 32 to "
                         f"256 and bf16 scale_offset, got K={k}, group_size={group_size}, {scale_offset.dtype}; "
                         "pack the codes with pack_int4 instead")
    if (scale_offset.shape != (n, k // group_size, 2) or not scale_offset.dtype.is_floating_point
            or not scale_offset.is_contiguous()):
        raise ValueError(f"w4_gemv: scale_offset {tuple(scale_offset.shape)} {scale_offset.dtype}; allowed: a "
                         f"contiguous floating-point [{n}, {k // group_size}, 2]")
    x2 = _check_rows(x, k, "w4_gemv")
    if not _use_triton(x2, "w4_gemv") or group_size < 2:  # a group of one has no byte of its own
        _CALLS["reference"] += 1
        return w4_gemv_reference(x2, qweight, scale_offset, group_size).reshape(*x.shape[:-1], n)
    _CALLS["triton"] += 1
    if words:
        return launch_w4i(x2, qweight, scale_offset, group_size).reshape(*x.shape[:-1], n)
    return launch_w4(x2, qweight, scale_offset, group_size).reshape(*x.shape[:-1], n)


@w4_gemv.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor, scale_offset: torch.Tensor, group_size: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))
