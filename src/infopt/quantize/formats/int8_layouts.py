"""The storage layouts of :class:`~infopt.quantize.formats.int8.Int8Linear`'s codes, one small class each.

A layout owns what differs between them: the buffers it keeps for the int8 codes, setting the codes into them and
reading them back (exactly), looking rows up, whether the buffers are saved as they are, and the product for a call.
:class:`Int8Linear` keeps its public ``activations`` (``"float"`` or ``"int8"``: what configs save) and the name of the
layout those choose (``layer.layout``), and asks :data:`LAYOUTS` for the rest; ``compile.fuse`` asks
:attr:`Int8Layout.concatenates` instead of testing ``activations``.

Every layout saves the codes as ``weight_int8`` int8 ``[out, in]`` (the ``state_dict`` format); ``weight_scale`` (fp32
``[out]``, or ``[out, in // group_size]``) is the layer's own, the same in every layout.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading

import torch
import torch.nn.functional as F

from ...ops.triton_gemv import GEMV_MAX_ROWS, w8_gemv
from ...ops.triton_int8 import MM_DTYPES, int8_weight_mm
from . import a8

_FILLED_NEXT = contextvars.ContextVar("infopt_int8_filled_next", default=False)


@contextlib.contextmanager
def filled_next():
    """Within the block, a layout's :meth:`~Int8Layout.empty` buffers are left uninitialised: the caller overwrites
    every one at once (``Int8Linear.from_codes``), so zeroing them first would only touch their pages (a 152k-token
    head: 136 MB more at a load's peak)."""
    token = _FILLED_NEXT.set(True)
    try:
        yield
    finally:
        _FILLED_NEXT.reset(token)


def _alloc(*shape, dtype, device) -> torch.Tensor:
    return (torch.empty if _FILLED_NEXT.get() else torch.zeros)(*shape, dtype=dtype, device=device)

__all__ = ["Int8Layout", "LAYOUTS", "BY_ACTIVATIONS", "act_group", "factor_k6_scales"]

# Triton's CPU interpreter (tests): CPU layers take the Triton ops' routes, as CUDA layers do (read once, at import)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

_SCRATCH = threading.local()
_CHUNK_WEIGHTS = 1 << 20
"""Weights dequantized at a time by :func:`_dequantized_matmul` (4 MiB of fp32: stays in the caches)."""


def _dequantized_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` fp32 times the dequantized ``codes [N, K]`` (``scale [N]`` or ``[N, G]``): ``[M, N]`` fp32.

    The weight is dequantized a chunk of rows at a time into one reused per-thread buffer, each chunk's product
    written straight into the output: no full fp32 copy of the weight is allocated per call (for the default model's
    prompts that copy was 540 MB per token batch, most of its time in page faults).
    """
    n, k = codes.shape
    rows = max(1, min(n, _CHUNK_WEIGHTS // k))
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < rows * k:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode alike
            buf = _SCRATCH.buf = torch.empty(max(rows * k, _CHUNK_WEIGHTS), dtype=torch.float32)
    y_t = torch.empty(n, x.shape[0], dtype=torch.float32)
    xt = x.t()
    for i in range(0, n, rows):
        j = min(n, i + rows)
        w = buf[: (j - i) * k].view(j - i, k)
        w.copy_(codes[i:j])
        if scale.dim() == 1:
            w.mul_(scale[i:j, None])
        else:
            w.view(j - i, scale.shape[1], -1).mul_(scale[i:j, :, None])
        torch.mm(w, xt, out=y_t[i:j])
    return y_t.t().contiguous()


def _int8pack_available(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(torch, "_weight_int8pack_mm")


def act_group(in_features: int) -> int:
    """The activation group of an ``activations="int8"`` layer: 16 input channels (or 8, or 4, whichever divides
    ``in_features``). Finer than the int4 layers' 32: the head decides every token, and on the default model
    groups of 16 keep top-1 at 0.964 against 0.960 with 32, for ~0.1 ms more per token on its 49152 x 576
    weight (``benchmarks/a8_quality.py``).

    Example:
        >>> act_group(576), act_group(72), act_group(36)
        (16, 8, 4)
    """
    return next(g for g in (16, 8, 4, in_features) if in_features % g == 0)


class Int8Layout:
    """One storage layout of the int8 codes: its buffers, setting and reading the codes, and the product. Stateless:
    the layer holds the tensors.

    Example:
        >>> sorted(LAYOUTS), LAYOUTS["a8"].activations
        (['a8', 'plain'], 'int8')
        >>> LAYOUTS["plain"].concatenates, LAYOUTS["a8"].concatenates
        (True, False)
    """

    name = ""
    activations = ""
    """The value of ``Int8Linear.activations`` that picks this layout."""
    buffers: tuple[str, ...] = ()
    """The layer's buffers of codes in this layout (``weight_scale`` is the layer's in every layout)."""
    saves_buffers = True
    """Whether ``state_dict`` holds the buffers as they are; else they are converted to ``weight_int8`` and back."""
    concatenates = False
    """Whether layers in this layout concatenate along their outputs (rows), buffer by buffer: what fusing q/k/v
    and gate/up into one product needs (``compile.fuse``)."""

    def fits(self, out_features: int, in_features: int, group_size: int | None) -> str | None:
        """Why a layer of this shape cannot take this layout, or None when it can."""
        return None

    def empty(self, out_features: int, in_features: int, device) -> dict[str, torch.Tensor]:
        """The layout's buffers, zero (uninitialised within :func:`filled_next`), for a layer of this shape."""
        raise NotImplementedError

    def scales_set(self, layer) -> None:
        """The layer's ``weight_scale`` was set (constructed, built, loaded): refresh what the layout derives from it
        (nothing, by default)."""

    def set_codes(self, layer, codes: torch.Tensor) -> None:
        """Store the int8 codes ``[out, in]`` in the layer's buffers."""
        raise NotImplementedError

    def codes(self, layer) -> torch.Tensor:
        """The int8 codes ``[out, in]``, recovered exactly from the layer's buffers."""
        raise NotImplementedError

    def rows(self, layer, index: torch.Tensor) -> torch.Tensor:
        """The codes of rows ``index`` (any shape): int8 ``[*index.shape, in]``, reading only those rows."""
        raise NotImplementedError

    def matmul(self, layer, x: torch.Tensor) -> tuple[str, torch.Tensor]:
        """``x @ W.T`` (no bias) and the name of the kernel that ran (a key of ``int8.kernel_calls``)."""
        raise NotImplementedError


class Plain(Int8Layout):
    """The codes row-major, ``weight_int8`` int8 ``[out, in]``, saved as they are; activations stay floating point,
    and the product takes the first of infopt's C++ int8 x fp32 kernel, the weight dequantized, the Triton kernels,
    ``torch._weight_int8pack_mm`` and the reference that fits the call (``Int8WeightOnly``'s ``compute_dtype`` says
    which runs when)."""

    name, activations, buffers, saves_buffers, concatenates = "plain", "float", ("weight_int8",), True, True

    def empty(self, out_features, in_features, device):
        return {"weight_int8": _alloc(out_features, in_features, dtype=torch.int8, device=device)}

    def set_codes(self, layer, codes):
        layer.weight_int8.copy_(codes)

    def codes(self, layer):
        return layer.weight_int8

    def rows(self, layer, index):
        return layer.weight_int8[index]

    def matmul(self, layer, x):
        cd = layer.compute_dtype
        # fp32 activations and sums on CPU: compute_dtype float32, or auto (None) with group scales
        fp32_cpu = (x.dtype == torch.float32 and x.device.type == "cpu"
                    and (cd == torch.float32 or (cd is None and layer.group_size is not None)))
        if fp32_cpu and a8.available():
            # the int8 kernel (per-channel or per-group scales), decode and prompts alike (faster than an fp32 GEMM
            # over the dequantized weight at every row count measured, 4 to 2,048); called directly: this layer
            # runs about 200 times per token, and each Python step costs
            y = torch.ops.infopt.int8_f32_linear(x.reshape(-1, layer.in_features), layer.weight_int8,
                                                 layer.weight_scale)
            return "int8_f32_linear", y.view(*x.shape[:-1], layer.out_features)
        if fp32_cpu and not torch.compiler.is_compiling():
            # without the C++ kernels: the dequantized weight, a chunk of rows at a time
            y = _dequantized_matmul(x.reshape(-1, layer.in_features), layer.weight_int8, layer.weight_scale)
            return "dequantized_chunks", y.view(*x.shape[:-1], layer.out_features)
        if fp32_cpu:  # while compiling without the C++ kernels: the dequantized weight
            return "dequantized", F.linear(x, layer.dequantize())
        wd = cd or x.dtype
        if layer.group_size is not None:  # other devices and dtypes: the dequantized weight
            return "dequantized", F.linear(x.to(wd), layer.dequantize().to(wd)).to(x.dtype)
        if (x.is_cuda or _INTERPRET) and wd in MM_DTYPES:
            # the weight stays int8 in memory: the Triton kernel converts tiles in registers (the op falls back
            # to dequantize-then-matmul, warning once, where Triton is missing)
            if layer.cuda_kernel == "gemv" and x.numel() <= GEMV_MAX_ROWS * layer.in_features:
                return "w8_gemv", w8_gemv(x.to(wd), layer.weight_int8, layer.weight_scale).to(x.dtype)
            return "int8_weight_mm", int8_weight_mm(x.to(wd), layer.weight_int8, layer.weight_scale).to(x.dtype)
        if cd is not None and _int8pack_available(x.device) and cd in (torch.bfloat16, torch.float16):
            if not torch.compiler.is_compiling() and layer.weight_int8.data_ptr() % 64:
                # the CPU kernel's vector loads assume torch's 64-byte allocation alignment; a weight viewed into a
                # memory-mapped file at another offset can crash it (SIGSEGV), so take an allocation of our own;
                # is_compiling() first: dynamo cannot trace data_ptr() (the eager prompt pass before a compiled decode
                # step takes the copy)
                layer.weight_int8 = layer.weight_int8.clone()
            x2 = x.reshape(-1, layer.in_features).to(cd).contiguous()
            y = torch._weight_int8pack_mm(x2, layer.weight_int8, layer._scale(cd))
            return "weight_int8pack_mm", y.to(x.dtype).reshape(*x.shape[:-1], layer.out_features)
        y = F.linear(x.to(wd), layer.weight_int8.to(wd)) * layer._scale(wd)
        return "reference", y.to(x.dtype)


class A8(Int8Layout):
    """Int8 dynamic activations times the codes in integers (:func:`infopt.quantize.formats.a8.int8_a8_linear`): the
    codes in :mod:`~infopt.quantize.formats.a8`'s blocks of 16 rows, ``weight_a8`` uint8 ``[out/16, in/4, 64]`` (each
    code plus 128), activations quantized per group of :func:`act_group` input channels; rebuilt from
    ``weight_int8`` when loaded, not saved. Per-channel scales serve as they are; group scales (per a whole
    number of activation groups, applied to each group's dot products) are read from a blocked copy of
    ``weight_scale``, ``wscale`` fp32 ``[out/16, in/group_size, 16]`` (:func:`~infopt.quantize.formats.a8.block_scales`:
    one vector load per group, where a gather from the row-major scales was the kernel's bottleneck), kept in step by
    :meth:`scales_set` and not saved. Scales per 16 inputs that are a GGUF Q6_K file's (an fp16 ``d`` per 256 inputs
    times an int8 ``sc`` per 16, :func:`factor_k6_scales`) are kept in that form instead, uint8 ``[out/16, in/256,
    288]`` (:func:`~infopt.quantize.formats.a8.pack_k6_scales`): the kernel computes the same fp32 scales from them,
    and a call reads 0.56 bits a weight of scales instead of 2."""

    name, activations, buffers, saves_buffers, concatenates = "a8", "int8", ("weight_a8",), False, False

    def fits(self, out_features, in_features, group_size):
        if out_features % a8.ROWS or in_features % 4:
            return (f"activations='int8' needs out_features divisible by {a8.ROWS} and in_features by 4; got "
                    f"{in_features} -> {out_features}")
        if group_size is not None and group_size % act_group(in_features):
            return (f"activations='int8' needs group_size null (one scale per channel) or a multiple of the "
                    f"activation group, {act_group(in_features)} for {in_features} input channels; got {group_size}")
        return None

    def empty(self, out_features, in_features, device):
        blocks = out_features // a8.ROWS
        return {"weight_a8": _alloc(blocks, in_features // 4, 4 * a8.ROWS, dtype=torch.uint8, device=device)}

    def scales_set(self, layer):
        if layer.group_size is None:
            return
        k6 = factor_k6_scales(layer.weight_scale) if layer.group_size == 16 and not layer.weight_scale.is_meta \
            else None
        layer.register_buffer("wscale", a8.block_scales(layer.weight_scale) if k6 is None else a8.pack_k6_scales(*k6),
                              persistent=False)

    def set_codes(self, layer, codes):
        layer.weight_a8 = a8.pack_blocked_int8(codes.to(layer.weight_a8.device))

    def codes(self, layer):
        return a8.unpack_blocked_int8(layer.weight_a8)

    def rows(self, layer, index):
        # block layout [N/16, K/4, 16 rows, 4 columns]
        blocks = layer.weight_a8.view(layer.out_features // a8.ROWS, layer.in_features // 4, a8.ROWS, 4)
        return a8.biased(blocks[index // a8.ROWS, :, index % a8.ROWS].reshape(*index.shape, layer.in_features))

    def matmul(self, layer, x):
        scale = layer.weight_scale if layer.group_size is None else layer.wscale
        return "int8_a8_linear", a8.int8_a8_linear(x, layer.weight_a8, scale, layer.act_group)


def factor_k6_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Group scales ``[N, Gw]`` (per 16 inputs) as Q6_K's two-level scales ``(d, sc)``, fp16 ``[N, Gw/16]`` and
    integers -128..127 ``[N, Gw]`` with ``d * sc == scale`` exactly in fp32, or None where they do not factor so (or
    ``N`` is not a whole number of blocks). Tries each super-block's largest magnitude as 128, 127, ... units (a Q6_K
    quantizer gives it -128 or 127: one or two tries).

    Example:
        >>> d, sc = factor_k6_scales(torch.tensor([[0.5, -1.0] * 8] * 16))
        >>> d[0].tolist(), sc[0, :2].tolist()
        ([0.0078125], [64.0, -128.0])
        >>> factor_k6_scales(torch.full((16, 16), 0.1)) is None
        True
    """
    n, g = scales.shape
    if g % a8.K6_SUPER or n % a8.ROWS or scales.dtype != torch.float32 or not bool(torch.isfinite(scales).all()):
        return None
    v = scales.reshape(n, -1, a8.K6_SUPER)
    # (multiples up to 128 units: -128 is an int8 sc, and a magnitude of 128 units is found as the top one)
    got = a8.factor_two_level(v, 128, -128, lambda u, q: ((q <= 127).all(-1) & (u.unsqueeze(-1) * q == v).all(-1)))
    return None if got is None else (got[0].to(torch.float16), got[1].reshape(n, g))


LAYOUTS: dict[str, Int8Layout] = {layout.name: layout for layout in (Plain(), A8())}
"""Every layout by name (``Int8Linear.layout``)."""

BY_ACTIVATIONS: dict[str, str] = {layout.activations: name for name, layout in LAYOUTS.items()}
"""The layout's name for each value of ``Int8Linear.activations``."""
