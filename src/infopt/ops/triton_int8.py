"""A Triton kernel for int8 weight-only linears on CUDA: ``y = x @ (w_int8 * scale[:, None]).T``, the weight read as int8.

Dequantize-then-matmul (``F.linear(x, w_int8.to(x.dtype)) * scale``) writes and reads a full-precision copy
of every weight on every call: for a decode step, which is bound by weight reads, that is three times the
bytes of the int8 weight (bf16: 1 byte read + 2 written + 2 read again). The kernel below loads int8 tiles of
the weight and converts them to the activation dtype in registers, so the weight crosses memory once as int8.
The per-output-channel scale is applied to the fp32 accumulator after the K loop (one multiply per output,
not per weight).

It is registered as the custom op ``torch.ops.infopt.int8_weight_mm`` (with a fake implementation), so
``torch.compile`` traces it as one opaque call and CUDA graphs capture its launch. Triton is imported on the
first launch only: ``import infopt`` neither imports it nor initializes CUDA. Without Triton (or on a GPU
that cannot take the activation dtype) the op computes dequantize-then-matmul, warning once.

Tile sizes come from a fixed table by row count (no autotuning, so results do not depend on a timing run):
16-row tiles over narrow column blocks for 1-16 rows (decode: many programs, deep K tiles, memory bound),
wider tiles as rows grow (prefill: compute bound).
"""

# no `from __future__ import annotations`: torch.library.custom_op reads the op's schema from real annotations

import functools
import importlib.util
import os
import warnings

import torch
import torch.nn.functional as F

__all__ = ["int8_weight_mm", "int8_weight_mm_reference", "triton_available", "kernel_calls", "MM_DTYPES"]

MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Activation dtypes the kernel takes (the output has the activation's dtype)."""

triton = tl = None  # bound to the modules by _kernel(), on the first launch
_CALLS = {"triton": 0, "reference": 0}  # eager launches per path (a diagnostic; CUDA graph replays do not count)
_WARNED = False


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported (checked once, without importing it).

    Example:
        >>> isinstance(triton_available(), bool)
        True
    """
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def kernel_calls() -> dict[str, int]:
    """Calls of :func:`int8_weight_mm` since import per path: ``triton`` (the kernel) and ``reference``
    (dequantize-then-matmul). Calls replayed from a CUDA graph run no Python and are not counted.

    Example:
        >>> sorted(kernel_calls())
        ['reference', 'triton']
    """
    return dict(_CALLS)


def int8_weight_mm_reference(x: torch.Tensor, weight_int8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Dequantize-then-matmul in ``x``'s dtype: what :class:`~infopt.quantize.Int8Linear` computed before the kernel.

    Args:
        x: ``[..., K]`` activations. weight_int8: int8 ``[N, K]``. scale: fp32 ``[N]``.

    Returns:
        ``[..., N]`` in ``x.dtype``.

    Example:
        >>> w = torch.tensor([[1, -2], [3, 4]], dtype=torch.int8)
        >>> int8_weight_mm_reference(torch.ones(1, 2), w, torch.tensor([0.5, 1.0])).tolist()
        [[-0.5, 7.0]]
    """
    return F.linear(x, weight_int8.to(x.dtype)) * scale.to(x.dtype)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (tests)


@functools.cache
def _bf16_dot_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 0)  # bf16 tensor-core dots need Ampere or newer


def _use_triton(x: torch.Tensor) -> bool:
    global _WARNED
    if not (x.is_cuda or _interpreting()) or x.dtype not in MM_DTYPES:
        return False
    if not triton_available():
        if not _WARNED:
            _WARNED = True
            warnings.warn("infopt int8 weight-only: Triton is not installed, so Int8Linear on CUDA converts each "
                          "int8 weight to the activation dtype on every call (more memory traffic than the int8 "
                          "kernel); pip install triton", RuntimeWarning, stacklevel=3)
        return False
    index = x.device.index if x.device.index is not None else (torch.cuda.current_device() if x.is_cuda else 0)
    if x.is_cuda and x.dtype == torch.bfloat16 and not _bf16_dot_ok(index):
        return False
    return True


@functools.cache
def _kernel():
    """Import Triton and build the kernel, once. The names are bound at module level so the kernel body finds
    ``tl`` among its globals, as Triton's compiler and interpreter look names up there."""
    global triton, tl
    import triton
    import triton.language as tl

    @triton.jit
    def int8_weight_mm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, stride_xm, stride_xk, stride_wn, stride_wk,
                              stride_ym, stride_yn, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, IEEE: tl.constexpr, VIA_F32: tl.constexpr):
        # K is a compile-time constant: a layer's width never changes, so each width compiles once and the loop
        # bound and the tail mask are known to the compiler (a runtime bound also trips Triton's CPU interpreter
        # under NumPy 2)
        # program (pid_m, pid_n) computes y[pid_m * BLOCK_M :, pid_n * BLOCK_N :], a [BLOCK_M, BLOCK_N] tile;
        # rows vary fastest, so programs on the same weight columns run together and share them through L2
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < M
        mask_n = offs_n < N
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
        w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn  # [BLOCK_K, BLOCK_N] of w.T
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, (K + BLOCK_K - 1) // BLOCK_K):
            if K % BLOCK_K == 0:
                a = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
                b = tl.load(w_ptrs, mask=mask_n[None, :], other=0)
            else:
                k_ok = offs_k < K - kb * BLOCK_K
                a = tl.load(x_ptrs, mask=mask_m[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=k_ok[:, None] & mask_n[None, :], other=0)
            if VIA_F32:
                # Triton's CPU interpreter (tests) gets int8 -> bf16 conversions and bf16 dots wrong (NaN, garbage):
                # there both operands go to fp32, exact for int8 codes and for bf16 / fp16 activations
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc=acc, input_precision="ieee")
            elif IEEE:  # fp32 activations: full fp32 products, not TF32
                acc = tl.dot(a, b.to(tl.float32), acc=acc, input_precision="ieee")
            else:  # int8 -> bf16 / fp16 in registers (exact for -128..127), tensor-core dot into fp32
                acc = tl.dot(a, b.to(x_ptr.dtype.element_ty), acc=acc)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        scale = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)  # [BLOCK_N], one per output channel
        y = (acc * scale[None, :]).to(y_ptr.dtype.element_ty)
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
        tl.store(y_ptrs, y, mask=mask_m[:, None] & mask_n[None, :])

    return int8_weight_mm_kernel


def _pow2_at_least_16(v: int) -> int:
    return max(16, 1 << (max(1, v) - 1).bit_length())


def tile_config(m: int, n: int, k: int, x_bytes: int = 2) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` for an ``[m, k] x [k, n]`` product.

    1-16 rows (decode) take one 16-row tile (``tl.dot``'s minimum) over 32 weight columns, so a 4096-wide
    layer spreads over 128 programs, each streaming 256-deep int8 tiles through a 4-stage pipeline; more
    rows take wider tiles. Every block is at least 16 (``tl.dot``) and no larger than the next power of two
    of its dimension. fp32 activations (``x_bytes=4``) take shallower K tiles or fewer stages past 16 rows,
    so that every config stays within 100 KiB of shared memory (sm_86's limit; measured by compiling for
    sm_80, sm_86 and sm_90: at most 80 KiB).

    Example:
        >>> tile_config(1, 4096, 4096)
        (16, 32, 256, 4, 4)
    """
    if m <= 16:
        bm, bn, bk, warps, stages = 16, 32, 256, 4, 4
    elif m <= 64:
        bm, bn, bk, warps, stages = 64, 64, 128 if x_bytes <= 2 else 64, 4, 4
    else:
        bm, bn, bk, warps, stages = 128, 128, 64, 8, 3 if x_bytes <= 2 else 2
    return (min(bm, _pow2_at_least_16(m)), min(bn, _pow2_at_least_16(n)), min(bk, _pow2_at_least_16(k)),
            warps, stages)


def _launch(x2: torch.Tensor, weight_int8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # x2: [M, K]; weight_int8: [N, K]; scale: [N] fp32 -> y: [M, N] in x2's dtype
    kernel = _kernel()
    m, k = x2.shape
    n = weight_int8.shape[0]
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    if m == 0 or n == 0:
        return y
    bm, bn, bk, warps, stages = tile_config(m, n, k, x2.element_size())
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    args = (x2, weight_int8, scale, y, m, n, x2.stride(0), x2.stride(1), weight_int8.stride(0),
            weight_int8.stride(1), y.stride(0), y.stride(1))
    meta = {"K": k, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "IEEE": x2.dtype == torch.float32,
            "VIA_F32": not x2.is_cuda, "num_warps": warps, "num_stages": stages}
    if x2.is_cuda:
        with torch.cuda.device(x2.device):  # Triton launches on the current device
            kernel[grid](*args, **meta)
    else:  # TRITON_INTERPRET=1 on CPU tensors
        kernel[grid](*args, **meta)
    return y


@torch.library.custom_op("infopt::int8_weight_mm", mutates_args=())
def int8_weight_mm(x: torch.Tensor, weight_int8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ (weight_int8 * scale[:, None]).T`` with the weight read as int8 (the Triton kernel on CUDA).

    On CUDA with Triton installed (and bf16 only on Ampere or newer) the kernel runs; otherwise, and on CPU
    (unless ``TRITON_INTERPRET=1``), :func:`int8_weight_mm_reference`. A CUDA call without Triton warns once.

    Args:
        x: ``[..., K]`` activations, bfloat16, float16 or float32 (any row count, any strides).
        weight_int8: int8 ``[N, K]``.
        scale: ``[N]``, one per output channel (fp32; other float dtypes are read as they are).

    Returns:
        ``[..., N]`` in ``x.dtype`` (accumulated in fp32).

    Raises:
        ValueError: mismatched shapes or dtypes.

    Example:
        >>> w = torch.tensor([[1, -2], [3, 4]], dtype=torch.int8)
        >>> int8_weight_mm(torch.ones(1, 2), w, torch.tensor([0.5, 1.0])).tolist()
        [[-0.5, 7.0]]
    """
    if weight_int8.dtype != torch.int8 or weight_int8.dim() != 2 or x.shape[-1] != weight_int8.shape[1]:
        raise ValueError(f"int8_weight_mm: x {tuple(x.shape)} and weight {tuple(weight_int8.shape)} "
                         f"{weight_int8.dtype}; allowed: x [..., K] and an int8 weight [N, K]")
    if scale.shape != (weight_int8.shape[0],) or not scale.dtype.is_floating_point:
        raise ValueError(f"int8_weight_mm: scale {tuple(scale.shape)} {scale.dtype}; allowed: a floating-point "
                         f"[{weight_int8.shape[0]}] (one per output channel; fp32 keeps the most precision)")
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if _use_triton(x2):
        _CALLS["triton"] += 1
        y = _launch(x2, weight_int8, scale)
    else:
        _CALLS["reference"] += 1
        y = int8_weight_mm_reference(x2, weight_int8, scale)
    return y.reshape(*x.shape[:-1], weight_int8.shape[0])


@int8_weight_mm.register_fake
def _(x: torch.Tensor, weight_int8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight_int8.shape[0]))
