"""The storage layouts of :class:`~infopt.quantize.formats.int4.Int4Linear`, one small class each.

A layout owns what differs between kernels: the buffers it keeps, packing the portable codes into them, recovering
the portable codes from them (exactly), and the product for a call. :class:`Int4Linear` holds the layout's name
(``layer.layout``, saved as such) and asks :data:`LAYOUTS` for the rest; ``compile.fuse`` and ``parallel`` ask the
layout (:attr:`Int4Layout.concatenates`, :meth:`Int4Layout.fits`) instead of testing its name.

The portable layout (the ``state_dict``): ``qweight`` uint8 ``[out, in // 2]`` (column ``2j`` in the low nibble),
``scales`` and ``zeros`` fp32 ``[out, in // group_size]``; a weight is ``(code - zero) * scale``. The kernel layouts
store bf16 ``(scale, offset)`` pairs with ``w = (code - 8) * scale + offset``, the offset derived from the bf16 scale
so that a save (which recovers the zero point from both) and a reload give the very same values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops.triton_gemv import GEMV_MAX_ROWS, w4_dequantize, w4_gemv
from . import a8
from .primitives import dequantize, pack_int4, unpack_int4

__all__ = ["Int4Layout", "LAYOUTS", "BUFFERS", "A8_LAYOUTS", "cuda_inner_k_tiles", "symmetric", "factor_k_scales",
           "A8_PROMPT_MIN_ROWS"]

A8_LAYOUTS = ("a8", "a8_sym", "a8_k")
"""The layouts multiplied on int8 activations (:mod:`infopt.quantize.formats.a8`'s kernels)."""

A8_PROMPT_MIN_ROWS = 64
"""Rows from which an ``a8`` layer without a dense copy, on a CPU with native bf16 GEMMs
(:func:`~infopt.core.availability.fast_bf16_gemm`), dequantizes its weight to bf16 for the call
(:func:`infopt.quantize.formats.a8.int4_dense_t`) and runs one GEMM instead of the integer kernel (prompts). An
estimate: the resident copy's crossover (``A8_DENSE_MIN_ROWS``) plus the dequantization's cost, not yet measured on
such a CPU. Elsewhere the integer kernel keeps every row count: on a 2-core AVX2 EPYC a 576x1536 layer takes 4.6 ms at
512 rows in it against 7.2 ms dequantized to fp32 (and 6.2 ms for a resident fp32 weight; ``benchmarks/int4_rows.py``)."""


def cuda_inner_k_tiles(in_features: int) -> int | None:
    """The ``innerKTiles`` of torch's CUDA int4 packing for a layer with ``in_features`` inputs, or None.

    ``torch._convert_weight_to_int4pack`` tiles the input dimension in blocks of ``16 * innerKTiles``
    (``innerKTiles`` 2, 4 or 8) and takes no padding, so ``in_features`` must be a multiple of the block:
    576 (the default model) takes 4, 1536 takes 8, 48 takes none (the layer stays in the portable layout).

    Example:
        >>> cuda_inner_k_tiles(4096), cuda_inner_k_tiles(576), cuda_inner_k_tiles(96), cuda_inner_k_tiles(48)
        (8, 4, 2, None)
    """
    for tiles in (8, 4, 2):
        if in_features % (16 * tiles) == 0:
            return tiles
    return None


def _kernel_scale_offset(scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s16 = scales.to(torch.bfloat16).float()
    return s16, (8.0 - zeros.float()) * s16


class Int4Layout:
    """One storage layout: its buffers, packing, unpacking and product. Stateless: the layer holds the tensors.

    Example:
        >>> sorted(LAYOUTS)
        ['a8', 'a8_k', 'a8_sym', 'cpu_int4pack', 'cuda_tinygemm', 'gemv', 'plain']
        >>> LAYOUTS["gemv"].concatenates, LAYOUTS["cpu_int4pack"].concatenates
        (True, False)
    """

    name = ""
    buffers: tuple[str, ...] = ()
    """The layer's buffers in this layout (the weight's codes and scales)."""
    storage = "scale_offset"
    """The buffer whose device is the layer's."""
    concatenates = False
    """Whether layers in this layout concatenate along their outputs (rows), buffer by buffer: what fusing q/k/v
    and gate/up into one product needs (``compile.fuse``)."""

    def fits(self, out_features: int, in_features: int, group_size: int) -> str | None:
        """Why a layer of this shape cannot take this layout, or None when it can."""
        return None

    def empty(self, out_features: int, in_features: int, group_size: int, device) -> dict[str, torch.Tensor]:
        """The layout's buffers, empty, for a layer of this shape."""
        raise NotImplementedError

    def pack(self, layer, qweight: torch.Tensor | None, scales: torch.Tensor, zeros: torch.Tensor,
             codes: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The buffers holding the portable weight (``qweight`` packed, or ``codes`` ``[out, in]`` unpacked)."""
        raise NotImplementedError

    def unpack(self, layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(qweight, scales, zeros)`` in the portable layout, recovered exactly from the layer's buffers."""
        raise NotImplementedError

    def matmul(self, layer, x: torch.Tensor, rows: int, fast_bf16: bool) -> tuple[str, torch.Tensor]:
        """``x @ W.T`` (no bias) and the name of the kernel that ran (a key of ``int4.kernel_calls``)."""
        raise NotImplementedError


class Plain(Int4Layout):
    """The portable layout itself, dequantized per call: any device, the reference path."""

    name, storage, concatenates = "plain", "qweight", False
    buffers = ("qweight", "scales", "zeros")

    def empty(self, out_features, in_features, group_size, device):
        groups = in_features // group_size
        return {"qweight": torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device),
                "scales": torch.ones(out_features, groups, dtype=torch.float32, device=device),
                "zeros": torch.full((out_features, groups), 8.0, dtype=torch.float32, device=device)}

    def pack(self, layer, qweight, scales, zeros, codes):
        return {"qweight": (qweight if qweight is not None else pack_int4(codes)).contiguous(),
                "scales": scales.float().contiguous(), "zeros": zeros.float().contiguous()}

    def unpack(self, layer):
        return layer.qweight, layer.scales, layer.zeros

    def matmul(self, layer, x, rows, fast_bf16):
        w = dequantize(unpack_int4(layer.qweight), (1, layer.group_size), layer.scales, layer.zeros, dtype=x.dtype)
        return "plain", F.linear(x, w)


class A8(Int4Layout):
    """Int8 dynamic activations times the int4 codes in integers (:mod:`infopt.quantize.formats.a8`'s blocks): the
    C++ kernel on the CPU, its torch reference elsewhere; prompts on CPUs with native bf16 GEMMs dequantize the
    weight for the call instead."""

    name, storage, concatenates = "a8", "scale_min", False
    buffers = ("weight_packed", "scale_min")

    def fits(self, out_features, in_features, group_size):
        if out_features % a8.ROWS or group_size % 8:
            return (f"the a8 layout needs out_features divisible by {a8.ROWS} and group_size by 8, got {out_features} "
                    f"and {group_size}")
        return None

    def empty(self, out_features, in_features, group_size, device):
        blocks = out_features // a8.ROWS
        return {"weight_packed": torch.zeros(blocks, in_features // 8, 64, dtype=torch.uint8, device=device),
                "scale_min": torch.zeros(blocks, in_features // group_size, 2, a8.ROWS, dtype=torch.bfloat16,
                                         device=device)}

    def pack(self, layer, qweight, scales, zeros, codes):
        codes = unpack_int4(qweight) if codes is None else codes
        weight, scale_min = a8.pack_blocked_int4(codes, scales, zeros)
        return {"weight_packed": weight, "scale_min": scale_min}

    def unpack(self, layer):
        codes, scales, zeros = a8.unpack_blocked_int4(layer.weight_packed, layer.scale_min)
        return pack_int4(codes), scales, zeros

    def matmul(self, layer, x, rows, fast_bf16):
        if rows >= A8_PROMPT_MIN_ROWS and fast_bf16:  # prompts: one bf16 GEMM over the weight dequantized for the call
            k, n = layer.weight_packed.shape[1] * 8, layer.weight_packed.shape[0] * a8.ROWS  # the [K, N] it writes
            # into a buffer kept for the next layer (new pages cost more than the dequantization), unless autograd
            # would keep it as the product's operand or a graph is being traced
            keep = x.device.type == "cpu" and not torch.compiler.is_compiling() and not (
                torch.is_grad_enabled() and x.requires_grad)
            w_t = a8.int4_dense_t(layer.weight_packed, layer.scale_min, layer.group_size, torch.bfloat16,
                                  out=a8.dense_scratch(k, n, torch.bfloat16) if keep else None)
            return "a8_prompt", torch.matmul(x.to(torch.bfloat16), w_t).to(x.dtype)
        return "a8", a8.int4_a8_linear(x, layer.weight_packed, layer.scale_min, layer.group_size)


class A8Sym(A8):
    """:class:`A8` for symmetric codes (``w = (code - 8) * scale``: every GGUF Q4_0 block, and infopt's symmetric
    round-to-nearest): fp16 scales alone, ``scale_min`` ``[N/16, G, 16]``, 4.5 bits a weight where :class:`A8` holds
    5 (a bf16 scale and minimum per group), so decode reads 10% fewer weight bytes, and a Q4_0 file's scales are kept
    exactly (fp16) instead of rounded to bf16. The same kernels (they tell the two apart by the scales' dtype). Scales
    below fp16's normal range (under 6.1e-5: a group of weights all under ~4.6e-4) keep fewer bits than bf16's 8."""

    name = "a8_sym"

    def empty(self, out_features, in_features, group_size, device):
        blocks = out_features // a8.ROWS
        return {"weight_packed": torch.zeros(blocks, in_features // 8, 64, dtype=torch.uint8, device=device),
                "scale_min": torch.zeros(blocks, in_features // group_size, a8.ROWS, dtype=torch.float16,
                                         device=device)}

    def pack(self, layer, qweight, scales, zeros, codes):
        if not bool((zeros == 8).all()):
            raise ValueError("the a8_sym layout holds symmetric int4 codes only (every zero point 8); this weight's "
                             "are not: use the a8 layout")
        if bool((scales.float().abs() > 65504).any()):
            raise ValueError("the a8_sym layout keeps scales in fp16, and this weight has scales above 65504 (a group "
                             "absmax above ~490,000): use the a8 layout (bf16 scales)")
        codes = unpack_int4(qweight) if codes is None else codes
        weight, scale16 = a8.pack_blocked_int4_sym(codes, scales)
        return {"weight_packed": weight, "scale_min": scale16}


class A8K(A8):
    """:class:`A8` for a GGUF Q4_K file's blocks: the codes as :class:`A8` packs them, and Q4_K's two-level scales
    (an fp16 ``d`` and ``dmin`` per row and super-block of 8 groups, a 6-bit ``sc`` and ``m`` per group:
    ``w = code * (d * sc) - dmin * m``) as they are, ``scale_min`` uint8 ``[N/16, G/8, 320]``
    (:func:`infopt.quantize.formats.a8.pack_k_scales`). The kernels compute each group's fp32 scale and minimum
    from them exactly, so the layer multiplies by the file's very weights (:class:`A8` rounds Q4_K's scales, which
    hold up to 17 significant bits, to bf16) and reads 4.625 bits a weight instead of 5. Group 32 and ``in_features``
    a multiple of 256. Built from a file's blocks (``load_quantized``) or from portable codes whose scales factor
    exactly that way (a saved ``a8_k`` layer's, :func:`factor_k_scales`)."""

    name = "a8_k"

    def fits(self, out_features, in_features, group_size):
        if out_features % a8.ROWS or group_size != 32 or in_features % (32 * a8.K_SUPER):
            return (f"the a8_k layout needs out_features divisible by {a8.ROWS}, group_size 32 and in_features "
                    f"divisible by {32 * a8.K_SUPER}, got {out_features}, {group_size} and {in_features}")
        return None

    def empty(self, out_features, in_features, group_size, device):
        blocks, supers = out_features // a8.ROWS, in_features // (32 * a8.K_SUPER)
        return {"weight_packed": torch.zeros(blocks, in_features // 8, 64, dtype=torch.uint8, device=device),
                "scale_min": torch.zeros(blocks, supers, 320, dtype=torch.uint8, device=device)}

    def pack(self, layer, qweight, scales, zeros, codes):
        factors = factor_k_scales(scales, zeros)
        if factors is None:
            raise ValueError("the a8_k layout holds Q4_K's two-level scales (fp16 d x 6-bit sc per group of 32, per "
                             "256 inputs), and this weight's scales and zero points do not factor that way: use "
                             "the a8 layout")
        codes = unpack_int4(qweight) if codes is None else codes
        weight, _ = a8.pack_blocked_int4(codes, torch.ones_like(scales[:, :1]), torch.zeros_like(scales[:, :1]))
        return {"weight_packed": weight, "scale_min": a8.pack_k_scales(*factors)}


def factor_k_scales(scales: torch.Tensor, zeros: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Portable int4 scales and zero points ``[N, G]`` (group 32) as Q4_K's two-level scales ``(d, dmin, sc, m)``
    (fp16 ``[N, G/8]``, integers ``[N, G]``) that give them back exactly (``d * sc == scale`` and
    ``dmin * m / (d * sc) == zero`` in fp32, as :class:`A8K` unpacks), or None where there are none: what a saved
    ``a8_k`` layer reloads through. Only non-negative scales and minimums factor (Q4_K's are).

    Example:
        >>> d = torch.tensor([[0.5, 0.25]]).repeat_interleave(8, 1)
        >>> sc, m = torch.arange(1, 17.).view(1, 16), torch.full((1, 16), 3.0)
        >>> scales, zeros = d * sc, (0.125 * m) / (d * sc)
        >>> d16, dmin, sc2, m2 = factor_k_scales(scales, zeros)
        >>> bool(torch.equal(d16.float().repeat_interleave(8, 1) * sc2, scales))
        True
        >>> factor_k_scales(torch.full((1, 8), 0.1), torch.zeros(1, 8)) is None
        True
    """
    n, g = scales.shape
    if g % a8.K_SUPER or bool((scales <= 0).any()) or bool((zeros < 0).any()):
        return None
    sv = scales.float().reshape(n, -1, a8.K_SUPER)
    zv = zeros.float().reshape(n, -1, a8.K_SUPER)
    got = a8.factor_two_level(sv, 63, 0, lambda u, q: (u.unsqueeze(-1) * q == sv).all(-1))
    if got is None:
        return None
    d, sc = got
    low = zv * sv  # dmin * m, up to the rounding of the zero point
    mins = a8.factor_two_level(low, 63, 0, lambda u, q: ((u.unsqueeze(-1) * q) / sv == zv).all(-1))
    if mins is None:
        return None
    dmin, m = mins
    return d.to(torch.float16), dmin.to(torch.float16), sc.reshape(n, g), m.reshape(n, g)


def symmetric(zeros: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether codes with these zero points and scales fit :class:`A8Sym` without loss beyond fp16 rounding of the
    scales: every zero point 8 and every nonzero scale inside fp16's normal range (smaller ones would lose bits).

    Example:
        >>> symmetric(torch.full((2, 3), 8.0), torch.full((2, 3), 0.01)), symmetric(torch.full((2, 3), 7.0), torch.ones(2, 3))
        (True, False)
    """
    a = scales.float().abs()
    return bool((zeros == 8).all()) and bool(((a == 0) | ((a >= 6.2e-5) & (a <= 6.5e4))).all())


class Gemv(Int4Layout):
    """The portable codes with bf16 ``(scale, offset)`` pairs ``[out, groups, 2]``, multiplied by infopt's Triton GEMV
    (:func:`infopt.ops.triton_gemv.w4_gemv`) at up to ``GEMV_MAX_ROWS`` rows and dequantized for the call above
    that; its rows concatenate, so fused projections run one GEMV."""

    name, storage, concatenates = "gemv", "qweight", True
    buffers = ("qweight", "scale_offset")

    def empty(self, out_features, in_features, group_size, device):
        return {"qweight": torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device),
                "scale_offset": torch.zeros(out_features, in_features // group_size, 2, dtype=torch.bfloat16,
                                            device=device)}

    def pack(self, layer, qweight, scales, zeros, codes):
        s16, offset = _kernel_scale_offset(scales, zeros)
        return {"qweight": (qweight if qweight is not None else pack_int4(codes)).contiguous(),
                "scale_offset": torch.stack([s16, offset], dim=-1).to(torch.bfloat16).contiguous()}

    def unpack(self, layer):
        scales = layer.scale_offset[..., 0].float()
        return layer.qweight, scales, 8.0 - layer.scale_offset[..., 1].float() / scales

    def matmul(self, layer, x, rows, fast_bf16):
        if rows <= GEMV_MAX_ROWS:
            return "gemv", w4_gemv(x, layer.qweight, layer.scale_offset, layer.group_size)
        return "gemv_prompt", F.linear(x, w4_dequantize(layer.qweight, layer.scale_offset, layer.group_size, x.dtype))


class _Int4Pack(Int4Layout):
    """torch's own int4 kernels (bf16 activations) on their packed weight and bf16 ``(scale, offset)`` pairs
    ``[groups, out, 2]``; the packed rows do not concatenate."""

    storage, concatenates = "scale_offset", False
    buffers = ("weight_packed", "scale_offset")

    def empty(self, out_features, in_features, group_size, device):
        return {"weight_packed": torch.zeros(0, dtype=torch.uint8, device=device),
                "scale_offset": torch.zeros(in_features // group_size, out_features, 2, dtype=torch.bfloat16,
                                            device=device)}

    def _pack_codes(self, codes: torch.Tensor, in_features: int) -> torch.Tensor:
        raise NotImplementedError

    def _kernel(self, x, packed, group_size, scale_offset):
        raise NotImplementedError

    def pack(self, layer, qweight, scales, zeros, codes):
        s16, offset = _kernel_scale_offset(scales, zeros)
        codes = (unpack_int4(qweight) if codes is None else codes).to(torch.int32)  # [out, in]
        return {"weight_packed": self._pack_codes(codes, layer.in_features),
                "scale_offset": torch.stack([s16.t(), offset.t()], dim=-1).to(torch.bfloat16).contiguous()}

    def unpack(self, layer):
        # run the kernel on the identity with scale 1, offset 0: it returns (code - 8), exactly, as [in, out]
        ones = torch.zeros_like(layer.scale_offset)
        ones[..., 0] = 1.0
        eye = torch.eye(layer.in_features, dtype=torch.bfloat16, device=layer.weight_packed.device)
        got = self._kernel(eye, layer.weight_packed, layer.group_size, ones)
        codes = (got.t().float() + 8.0).round().to(torch.uint8)
        scales = layer.scale_offset[..., 0].t().float()
        offset = layer.scale_offset[..., 1].t().float()
        return pack_int4(codes), scales, 8.0 - offset / scales

    def matmul(self, layer, x, rows, fast_bf16):
        x2 = x.reshape(-1, layer.in_features).to(torch.bfloat16).contiguous()
        y = self._kernel(x2, layer.weight_packed, layer.group_size, layer.scale_offset)
        return self.name, y.to(x.dtype).reshape(*x.shape[:-1], layer.out_features)


class CpuInt4Pack(_Int4Pack):
    """``torch._weight_int4pack_mm_for_cpu``."""

    name = "cpu_int4pack"

    def _pack_codes(self, codes, in_features):
        return torch._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)

    def _kernel(self, x, packed, group_size, scale_offset):
        return torch._weight_int4pack_mm_for_cpu(x, packed, group_size, scale_offset)


class CudaTinygemm(_Int4Pack):
    """``torch._weight_int4pack_mm`` (tinygemm), which takes nibble pairs with the even column in the high nibble."""

    name = "cuda_tinygemm"

    def fits(self, out_features, in_features, group_size):
        if cuda_inner_k_tiles(in_features) is None:
            return (f"in_features {in_features} is not a multiple of 32, which the CUDA int4 kernel needs; build the "
                    "layer with layout='plain'")
        return None

    def _pack_codes(self, codes, in_features):
        return torch._convert_weight_to_int4pack(pack_int4(codes, order="high_first"), cuda_inner_k_tiles(in_features))

    def _kernel(self, x, packed, group_size, scale_offset):
        return torch._weight_int4pack_mm(x, packed, group_size, scale_offset)


LAYOUTS: dict[str, Int4Layout] = {layout.name: layout for layout in (Plain(), A8(), A8Sym(), A8K(), Gemv(), CpuInt4Pack(),
                                                                     CudaTinygemm())}
"""Every layout by name (``Int4Linear.layout``)."""

BUFFERS = tuple(dict.fromkeys(name for layout in LAYOUTS.values() for name in layout.buffers))
"""Every buffer name some layout keeps (a layer changing layout drops the others)."""
