"""The quantization formulas every infopt format is built from: qparams, quantize, dequantize, int4 packing.

One ``block_size`` describes the granularity, as in torchao's ``quant_primitives``: a tuple with one
entry per dimension of ``x``, each dividing that dimension; all elements of one block share one scale
(and zero point). Scales and zero points have the *grid* shape ``x.shape[i] // block_size[i]``:

- per tensor: ``block_size = x.shape`` (grid all ones);
- per row of ``[out, in]``: ``(1, in)`` (grid ``[out, 1]``);
- per group of ``g`` input channels: ``(1, g)`` (grid ``[out, in // g]``); :func:`group_block` builds it;
- a KV cache ``[B, H, T, D]`` per channel over ``g`` tokens: ``(1, 1, g, 1)``; per token over ``g``
  channels: ``(1, 1, 1, g)``.

Codes are integers in ``qmin..qmax`` (or float8 values for a float8 ``dtype``). The formats differ in
where their zero point lives (``zero_domain``), and the callers keep their conventions bit for bit:

- int4 weights, ``zero_point="int"``: 0..15, asymmetric, ``zero = round(-min / scale)`` (min..max widened
  to include 0), ``w = (q - zero) * scale``; ``zero_point="float"``: ``zero = -min / scale``, fractional.
- int4 symmetric, GPTQ/AWQ grids: 0..15 (0..254 for 8 bits), ``scale = absmax / 7.5`` (``/ 127``), zero 8
  (127), ``w = (q - zero) * scale``.
- int8 weights, W8A8 activations: -127..127, ``scale = absmax / 127``, no zero, ``w = q * scale``;
  float8_e4m3fn (weights and KV): the same with -448..448, and the cast rounds.
- int8/int4 KV cache (KIVI): 0..2^bits-1, ``scale = (max - min) / qmax``, ``zero = min`` (a value,
  ``zero_domain="value"``), ``x = q * scale + zero``.

Only ``torch`` is imported here, so any feature package can use these formulas.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["ZERO_DOMAINS", "NIBBLE_ORDERS", "group_block", "choose_qparams", "quantize", "dequantize",
           "pack_int4", "unpack_int4", "scale_dtype_for", "KeepsFormat"]

ZERO_DOMAINS: tuple[str, ...] = ("int", "float", "value")
"""Where a zero point lives. ``"int"``: an integer code (the range widened to include 0, so 0.0 is
exact); ``"float"``: a fractional code, ``-min / scale`` (the levels span exactly min..max); both
dequantize as ``(q - zero) * scale``. ``"value"``: the block's minimum itself, ``x ~= q * scale + zero``."""

NIBBLE_ORDERS: tuple[str, ...] = ("low_first", "high_first")
"""How :func:`pack_int4` places the pair ``(2j, 2j + 1)`` in byte ``j``: ``low_first`` puts element
``2j`` in the low nibble (infopt's portable int4 layout, the int4 KV cache); ``high_first`` in the
high nibble (the input of ``torch._convert_weight_to_int4pack``)."""


# -- blocks ----------------------------------------------------------------------------------------------
def group_block(shape: Sequence[int], group_size: int | None = None, axis: int = -1) -> tuple[int, ...]:
    """The ``block_size`` for groups of ``group_size`` consecutive elements along ``axis`` of ``shape``.

    Args:
        shape: the tensor's shape.
        group_size: elements per group; None for the whole axis (one scale per row along ``axis``).
        axis: the dimension the groups run along.

    Returns:
        A tuple of ones with ``group_size`` (or ``shape[axis]``) at ``axis``.

    Raises:
        ValueError: ``group_size`` does not divide ``shape[axis]``.

    Example:
        >>> group_block((16, 64), 32), group_block((16, 64)), group_block((1, 2, 64, 8), 16, axis=-2)
        ((1, 32), (1, 64), (1, 1, 16, 1))
    """
    axis = axis % len(shape)
    size = shape[axis] if group_size is None else group_size
    if size <= 0 or shape[axis] % size:
        raise ValueError(f"group_size {group_size} does not divide dimension {axis} of shape {tuple(shape)}")
    return tuple(size if i == axis else 1 for i in range(len(shape)))


def _grid(shape: Sequence[int], block_size: Sequence[int]) -> tuple[tuple[int, ...], bool]:
    """The shape of scales / zero points (one entry per block), and whether every dimension is per element or
    whole, so that a tensor of that shape broadcasts against ``x`` as it is (plain loops: this runs per call on
    hot paths such as W8A8's per-token activations)."""
    if len(block_size) != len(shape):
        raise ValueError(f"block_size {tuple(block_size)} does not tile a tensor of shape {tuple(shape)}: give one "
                         "positive divisor per dimension")
    grid = []
    direct = True
    for n, b in zip(shape, block_size, strict=True):
        if b <= 0 or n % b:
            raise ValueError(f"block_size {tuple(block_size)} does not tile a tensor of shape {tuple(shape)}: give "
                             "one positive divisor per dimension")
        grid.append(n // b)
        direct = direct and (b == 1 or n == b)
    return tuple(grid), direct


def _blocked(x: torch.Tensor, grid: tuple[int, ...], direct: bool, block_size: Sequence[int]
             ) -> tuple[torch.Tensor, list[int]]:
    """``x`` viewed so that a tensor of the grid shape, viewed by ``_per_block``, broadcasts over each block, and
    the dimensions one block spans in that view."""
    if direct:
        return x, [i for i, b in enumerate(block_size) if b != 1]
    # [n0, b0, n1, b1, ...]: each block's elements in the odd dimensions
    view = [d for n, b in zip(grid, block_size, strict=True) for d in (n, b)]
    return x.reshape(view), [2 * i + 1 for i, b in enumerate(block_size) if b != 1]


def _per_block(p: torch.Tensor, grid: tuple[int, ...], direct: bool) -> torch.Tensor:
    # a scale / zero of the grid shape, viewed to broadcast against _blocked(x)
    if p.shape != grid:
        if p.numel() != math.prod(grid):
            raise ValueError(f"a scale or zero point of shape {tuple(p.shape)} does not match the block grid {grid}")
        p = p.reshape(grid)
    return p if direct else p.reshape([d for n in grid for d in (n, 1)])


# -- qparams ---------------------------------------------------------------------------------------------
def choose_qparams(x: torch.Tensor, block_size: Sequence[int], *, qmin: float, qmax: float, symmetric: bool,
                   zero_domain: str = "int", eps: float | None = None, min_range: float | None = None,
                   scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scale and zero point of every block of ``x``, from its min/max (computed in fp32).

    Symmetric: ``scale = absmax / ((qmax - qmin) / 2)``, zero the middle code ``ceil((qmin + qmax) / 2)``
    (8 for 0..15, 127 for 0..254), or None when that is 0 (signed ranges such as -127..127).
    Asymmetric: ``scale = (max - min) / (qmax - qmin)``, the zero point as ``zero_domain`` says (see
    :data:`ZERO_DOMAINS`; ``"int"`` first widens min..max to include 0).

    The formats guard all-zero blocks differently, and each keeps its own guard: ``min_range`` floors
    the range (``absmax``, or ``max - min``) before the division, ``eps`` floors the scale after it.
    Without either, a constant block gets scale 0 (:func:`quantize` then gives it code 0, which
    ``zero_domain="value"`` dequantizes exactly).

    Args:
        x: the tensor (any float dtype).
        block_size: see the module docstring.
        qmin, qmax: the code range.
        symmetric: absmax mapping with a fixed zero point, or min/max mapping.
        zero_domain: ``"int"``, ``"float"`` or ``"value"`` (asymmetric only; symmetric takes ``"int"``).
        eps: floor of the scale.
        min_range: floor of the range before it is divided.
        scale_dtype: dtype of the returned scale and zero point (rounded once, at the end).

    Returns:
        ``(scale, zero)``, each of the grid shape ``x.shape[i] // block_size[i]``; ``zero`` is None
        for a symmetric signed range.

    Raises:
        ValueError: a ``block_size`` that does not tile ``x``, an unknown ``zero_domain``, or
            ``symmetric`` with a zero domain other than ``"int"``.

    Example:
        >>> x = torch.tensor([[-1.0, 0.0, 2.0, 6.5]])
        >>> choose_qparams(x, (1, 4), qmin=0, qmax=15, symmetric=False)
        (tensor([[0.5000]]), tensor([[2.]]))
        >>> choose_qparams(x, (1, 2), qmin=-127, qmax=127, symmetric=True)
        (tensor([[0.0079, 0.0512]]), None)
    """
    if zero_domain not in ZERO_DOMAINS:
        raise ValueError(f"zero_domain={zero_domain!r}; allowed: {', '.join(ZERO_DOMAINS)}")
    if symmetric and zero_domain != "int":
        raise ValueError(f"a symmetric mapping has an integer zero point (the middle code); got zero_domain="
                         f"{zero_domain!r}")
    grid, direct = _grid(x.shape, block_size)
    xb, dims = _blocked(x.float(), grid, direct, block_size)

    def reduce(t, fn):
        # [grid]: fn over each block (exact: max and min do not round, whatever the order)
        r = fn(t, dim=dims, keepdim=True) if dims else t
        return r if r.shape == grid else r.reshape(grid)

    span = float(qmax - qmin)
    if symmetric:
        scale = _floored(reduce(xb.abs(), torch.amax), span / 2, eps, min_range)
        mid = math.ceil((qmin + qmax) / 2)
        zero = torch.full_like(scale, float(mid)) if mid else None
    else:
        lo, hi = reduce(xb, torch.amin), reduce(xb, torch.amax)
        if zero_domain == "int":
            lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
        scale = _floored(hi - lo, span, eps, min_range)
        if zero_domain == "value":
            zero = lo
        else:
            zero = -lo / scale
            if qmin:
                zero = zero + qmin
            if zero_domain == "int":
                zero = torch.round(zero).clamp(qmin, qmax)
    if scale.dtype != scale_dtype:
        scale, zero = scale.to(scale_dtype), None if zero is None else zero.to(scale_dtype)
    return scale, zero


def _floored(r: torch.Tensor, div: float, eps: float | None, min_range: float | None) -> torch.Tensor:
    # r: a fresh [grid] tensor (a reduction or a difference), so it is updated in place
    if min_range is not None:
        r = r.clamp_(min=min_range)
    s = r.div_(div)
    return s if eps is None else s.clamp_(min=eps)


# -- quantize / dequantize ---------------------------------------------------------------------------------
def _is_float8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def quantize(x: torch.Tensor, block_size: Sequence[int], scale: torch.Tensor, zero: torch.Tensor | None = None, *,
             qmin: float, qmax: float, zero_domain: str = "int", dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """Codes of ``x`` on the grid ``(scale, zero)``, computed in fp32.

    ``round(x / scale + zero)`` (a code-domain zero), ``round((x - zero) / scale)`` (``zero_domain="value"``;
    a zero scale divides by 1) or ``round(x / scale)`` (no zero), clamped to ``qmin..qmax``. Rounding is
    half to even, after the zero point is added (as every caller always did: ``round(x + 127)`` and
    ``round(x) + 127`` differ on ties). A float8 ``dtype`` is not rounded: the cast rounds.

    Args:
        x: the tensor.
        block_size: see the module docstring.
        scale, zero: from :func:`choose_qparams` (or any tensors with the grid's number of elements).
        qmin, qmax: the code range.
        zero_domain: as given to :func:`choose_qparams`.
        dtype: dtype of the codes (a float dtype keeps integer-valued codes in it).

    Returns:
        Codes shaped like ``x``.

    Raises:
        ValueError: a ``block_size`` that does not tile ``x``, a scale or zero of another size.

    Example:
        >>> x = torch.tensor([[-1.0, 0.0, 2.0, 6.5]])
        >>> s, z = choose_qparams(x, (1, 4), qmin=0, qmax=15, symmetric=False)
        >>> q = quantize(x, (1, 4), s, z, qmin=0, qmax=15)
        >>> q.tolist(), dequantize(q, (1, 4), s, z).tolist()
        ([[0, 2, 6, 15]], [[-1.0, 0.0, 2.0, 6.5]])
    """
    grid, direct = _grid(x.shape, block_size)
    xb, _ = _blocked(x.float(), grid, direct, block_size)
    s = _per_block(scale, grid, direct).float()
    if zero is None:
        q = xb / s
    elif zero_domain == "value":
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = (xb - _per_block(zero, grid, direct).float()) / s
    else:
        q = (xb / s).add_(_per_block(zero, grid, direct).float())
    if not _is_float8(dtype):
        q = q.round_()
    q = q.clamp_(qmin, qmax)
    if q.dtype != dtype:
        q = q.to(dtype)
    return q if q.shape == x.shape else q.reshape(x.shape)


def dequantize(codes: torch.Tensor, block_size: Sequence[int], scale: torch.Tensor, zero: torch.Tensor | None = None,
               *, zero_domain: str = "int", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values codes stand for: ``(q - zero) * scale``, ``q * scale + zero`` (``zero_domain="value"``) or
    ``q * scale``, computed in ``dtype`` (codes, scale and zero cast to it first).

    Args:
        codes: integer (or float8) codes.
        block_size: see the module docstring.
        scale, zero: of the grid's number of elements.
        zero_domain: as given to :func:`choose_qparams`.
        dtype: the arithmetic's and the result's dtype (to compute in fp32 and return another dtype,
            cast the fp32 result).

    Returns:
        A tensor shaped like ``codes``.

    Raises:
        ValueError: a ``block_size`` that does not tile ``codes``, a scale or zero of another size.

    Example:
        >>> dequantize(torch.tensor([[0, 8, 15]], dtype=torch.uint8), (1, 3), torch.tensor([0.5]), torch.tensor([8.]))
        tensor([[-4.0000,  0.0000,  3.5000]])
    """
    grid, direct = _grid(codes.shape, block_size)
    q, _ = _blocked(codes.to(dtype), grid, direct, block_size)
    s = _per_block(scale, grid, direct).to(dtype)
    if zero is None:
        out = q * s
    elif zero_domain == "value":
        out = (q * s).add_(_per_block(zero, grid, direct).to(dtype))
    else:
        out = (q - _per_block(zero, grid, direct).to(dtype)).mul_(s)
    return out if out.shape == codes.shape else out.reshape(codes.shape)


def scale_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The dtype to keep scales and zero points in for a tensor of ``dtype`` that is quantized on the fly (a KV
    cache): float16 for float16, float32 otherwise (bfloat16's 8-bit mantissa is too coarse for a zero point).

    Example:
        >>> scale_dtype_for(torch.float16), scale_dtype_for(torch.bfloat16)
        (torch.float16, torch.float32)
    """
    return torch.float16 if dtype == torch.float16 else torch.float32


# -- int4 packing --------------------------------------------------------------------------------------------
def _pair_slices(ndim: int, dim: int) -> tuple[tuple, tuple]:
    even = [slice(None)] * ndim
    odd = [slice(None)] * ndim
    even[dim], odd[dim] = slice(0, None, 2), slice(1, None, 2)
    return tuple(even), tuple(odd)


def pack_int4(codes: torch.Tensor, dim: int = -1, order: str = "low_first") -> torch.Tensor:
    """Pack codes 0..15 two per byte along ``dim``: elements ``2j`` and ``2j + 1`` share byte ``j``.

    Args:
        codes: integer codes in 0..15 (any integer dtype; not checked), an even size along ``dim``.
        dim: the dimension that halves.
        order: ``"low_first"`` (element ``2j`` in the low nibble) or ``"high_first"`` (see :data:`NIBBLE_ORDERS`).

    Returns:
        uint8, contiguous, ``codes``' shape with ``dim`` halved.

    Raises:
        ValueError: an odd size along ``dim``, an unknown ``order``.

    Example:
        >>> c = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
        >>> pack_int4(c), pack_int4(c, order="high_first")
        (tensor([[33, 15]], dtype=torch.uint8), tensor([[ 18, 240]], dtype=torch.uint8))
        >>> torch.equal(unpack_int4(pack_int4(c)), c)
        True
    """
    if order not in NIBBLE_ORDERS:
        raise ValueError(f"pack_int4 order={order!r}; allowed: {', '.join(NIBBLE_ORDERS)}")
    dim = dim % codes.dim()
    if codes.shape[dim] % 2:
        raise ValueError(f"pack_int4 needs an even size along dim {dim}, got shape {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    even, odd = _pair_slices(c.dim(), dim)
    lo, hi = (c[even], c[odd]) if order == "low_first" else (c[odd], c[even])
    return (lo | (hi << 4)).contiguous()


def unpack_int4(packed: torch.Tensor, dim: int = -1, order: str = "low_first") -> torch.Tensor:
    """Inverse of :func:`pack_int4`: uint8 bytes to codes 0..15 (uint8), ``dim`` doubled.

    Example:
        >>> unpack_int4(torch.tensor([[33, 15]], dtype=torch.uint8)).tolist()
        [[1, 2, 15, 0]]
    """
    if order not in NIBBLE_ORDERS:
        raise ValueError(f"unpack_int4 order={order!r}; allowed: {', '.join(NIBBLE_ORDERS)}")
    dim = dim % packed.dim()
    lo, hi = packed & 0x0F, packed >> 4
    pair = (lo, hi) if order == "low_first" else (hi, lo)
    return torch.stack(pair, dim=dim + 1).flatten(dim, dim + 1)


class KeepsFormat(torch.nn.Module):
    """Base of infopt's quantized layers: a dtype cast of the model (``model.half()``, ``model.to(torch.bfloat16)``)
    reaches the layer's parameters (the bias) and the dtype it computes its outputs in (``out_dtype``), but not its
    buffers: codes, scales, zero points and FP8 weights are the quantized format, and rounding an fp32 scale to bf16
    (or an FP8 weight to bf16) would change the model the user measured, or break its kernel. Device moves reach
    every tensor as usual.

    Example:
        >>> from infopt.quantize import Int8Linear
        >>> layer = Int8Linear.from_float(torch.nn.Linear(64, 32)).to(torch.bfloat16)
        >>> layer.weight_scale.dtype, layer.bias.dtype, layer.out_dtype
        (torch.float32, torch.bfloat16, torch.bfloat16)
    """

    def _apply(self, fn, recurse=True):
        out_dtype = getattr(self, "out_dtype", None)
        if isinstance(out_dtype, torch.dtype):
            self.out_dtype = fn(torch.empty(0, dtype=out_dtype)).dtype
        buffers = {id(b) for b in self._buffers.values() if b is not None}

        def device_only(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in buffers:
                return fn(t)
            probe = fn(t.new_empty(0))
            if probe.dtype == t.dtype:  # a device move, to_empty, share_memory_: as for any module
                return fn(t)
            if t.device.type == "meta":
                return fn(t).to(t.dtype)  # no values to round
            return t if t.device == probe.device else t.to(probe.device)

        return super()._apply(device_only, recurse)
