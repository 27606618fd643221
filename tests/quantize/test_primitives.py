"""infopt.quantize.formats.primitives: property tests of the formulas, and every caller bit-identical to the formula it had
before it called them (frozen copies below, taken from commit 07ae873)."""

import ast
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import infopt.quantize.formats.primitives as primitives
from infopt.kvcache.quantized import dequantize_groups, quantize_groups
from infopt.kvcache.quantized import pack_int4 as kv_pack_int4
from infopt.kvcache.quantized import unpack_int4 as kv_unpack_int4
from infopt.quantize.algorithms.layerwise import Grid
from infopt.quantize.formats.fp8 import FP8Linear, dequantize_fp8, fp8_dtype, quantize_fp8
from infopt.quantize.formats.int4 import Int4Linear, quantize_int4_grouped
from infopt.quantize.formats.int4 import pack_int4 as int4_pack_int4
from infopt.quantize.formats.int4 import unpack_int4 as int4_unpack_int4
from infopt.quantize.formats.int8 import Int8Linear, quantize_int8_per_channel
from infopt.quantize.formats.primitives import choose_qparams, dequantize, group_block, pack_int4, quantize, unpack_int4
from infopt.quantize.formats.w8a8 import W8A8Linear, quantize_per_token


# -- the formulas as they were (frozen: do not edit) ----------------------------------------------------------
def old_quantize_int4_grouped(w, group_size, symmetric=False, zero_point="int"):
    out_f, in_f = w.shape
    g = w.detach().float().reshape(out_f, in_f // group_size, group_size)
    if symmetric:
        scale = (g.abs().amax(-1) / 7.5).clamp(min=1e-8)
        zero = torch.full_like(scale, 8.0)
    elif zero_point == "int":
        lo = g.amin(-1).clamp(max=0.0)
        hi = g.amax(-1).clamp(min=0.0)
        scale = ((hi - lo) / 15.0).clamp(min=1e-8)
        zero = torch.round(-lo / scale).clamp(0, 15)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15.0).clamp(min=1e-8)
        zero = -lo / scale
    codes = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, 15)
    return codes.reshape(out_f, in_f).to(torch.uint8), scale, zero


def old_int4_pack(codes):
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def old_int4_unpack(packed):
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def old_tinygemm_pairs(codes):
    codes = codes.to(torch.int32)
    return ((codes[:, 0::2] << 4) | codes[:, 1::2]).to(torch.uint8)


def old_int4_plain_weight(qweight, scales, zeros, g, dtype):
    return ((old_int4_unpack(qweight).to(dtype) - zeros.to(dtype).repeat_interleave(g, 1))
            * scales.to(dtype).repeat_interleave(g, 1))


def old_quantize_int8_per_channel(w, group_size=None):
    w32 = w.detach().float()
    out_f, in_f = w32.shape
    g = w32.reshape(out_f, 1 if group_size is None else in_f // group_size, -1)
    scale = g.abs().amax(dim=-1).clamp(min=1e-12) / 127.0
    q = torch.round(g / scale[..., None]).clamp_(-127, 127).to(torch.int8).reshape(out_f, in_f)
    return q, (scale[:, 0] if group_size is None else scale)


def old_quantize_per_token(x):
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12).div_(127.0)
    q = (x32 / scale).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale


class OldGrid:
    def __init__(self, bits, symmetric=False):
        self.bits, self.symmetric = bits, symmetric
        self.maxq = 15 if bits == 4 else 254

    def fit(self, w):
        w = w.float()
        if self.bits == 8:
            scale = (w.abs().amax(-1) / 127.0).clamp(min=1e-8)
            return scale, torch.full_like(scale, 127.0)
        if self.symmetric:
            scale = (w.abs().amax(-1) / 7.5).clamp(min=1e-8)
            return scale, torch.full_like(scale, 8.0)
        lo = w.amin(-1).clamp(max=0.0)
        hi = w.amax(-1).clamp(min=0.0)
        scale = ((hi - lo) / 15.0).clamp(min=1e-8)
        return scale, torch.round(-lo / scale).clamp(0, 15)

    def quantize(self, w, scale, zero):
        return torch.round(w / scale + zero).clamp_(0, self.maxq)

    def rtn(self, w, group_size):
        out_f, in_f = w.shape
        g = w.float().reshape(out_f, in_f // group_size, group_size)
        scale, zero = self.fit(g)
        codes = self.quantize(g, scale[..., None], zero[..., None])
        return codes.reshape(out_f, in_f), scale, zero

    @staticmethod
    def dequantize(codes, scales, zeros, group_size):
        out_f, in_f = codes.shape
        g = codes.float().reshape(out_f, in_f // group_size, group_size)
        return ((g - zeros[..., None]) * scales[..., None]).reshape(out_f, in_f)


def old_quantize_fp8(x, granularity="row"):
    x32 = x.float()
    if granularity == "row":
        amax = x32.abs().amax(dim=-1, keepdim=True)
    else:
        amax = x32.abs().amax().reshape(1)
    scale = amax.clamp(min=1e-12) / 448.0
    return (x32 / scale).clamp_(-448.0, 448.0).to(fp8_dtype()), scale


def old_dequantize_fp8(codes, scale, dtype=torch.float32):
    return (codes.float() * scale.float()).to(dtype)


def old_kv_pack(q):
    return q[..., 0::2] | (q[..., 1::2] << 4)


def old_kv_unpack(packed):
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def _old_grouped(x, group_size, axis):
    *lead, t, d = x.shape
    if axis == "channel":
        return x.reshape(*lead, t // group_size, group_size, d)
    return x.reshape(*lead, t, d // group_size, group_size)


def old_quantize_groups(x, bits, group_size, axis, scale_dtype=torch.float32):
    qmax = (1 << bits) - 1
    g = _old_grouped(x.float(), group_size, axis)
    red = -2 if axis == "channel" else -1
    lo = g.amin(dim=red, keepdim=True)
    hi = g.amax(dim=red, keepdim=True)
    scale = ((hi - lo) / qmax).to(scale_dtype)
    zero = lo.to(scale_dtype)
    s = scale.float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    codes = ((g - zero.float()) / s).round_().clamp_(0, qmax).to(torch.uint8).reshape(x.shape)
    if bits == 4:
        codes = old_kv_pack(codes)
    return codes, scale.squeeze(red), zero.squeeze(red)


def old_dequantize_groups(codes, scale, zero, bits, group_size, axis, dtype=torch.float32):
    q = old_kv_unpack(codes) if bits == 4 else codes
    red = -2 if axis == "channel" else -1
    g = _old_grouped(q, group_size, axis).float()
    out = g * scale.unsqueeze(red).float() + zero.unsqueeze(red).float()
    return out.reshape(q.shape).to(dtype)


# -- helpers ---------------------------------------------------------------------------------------------------
def assert_bitwise(a, b):
    """Same dtype, shape and bytes (so -0.0 != 0.0 and NaN payloads count)."""
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_bitwise(x, y)
        return
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    assert torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


def edge_weights(rows=16, cols=128, seed=0):
    """Rows that hit every guard and tie: zeros, a constant, tiny (below the 1e-12 / 1e-8 floors), one-signed,
    half-zero, exact .5 ties, integer grids."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    w[0] = 0
    w[1] = 3.25
    w[2] = 1e-13
    w[3, ::3] = -1e-9
    w[4] = 1e-7 * torch.randn(cols, generator=g)
    w[5] = w[5].abs()
    w[6] = -w[6].abs()
    w[7, : cols // 2] = 0
    w[8] = torch.arange(cols) / 2.0 - 30
    w[9] = torch.linspace(-7.5, 7.5, cols)
    w[10] = torch.randint(-8, 8, (cols,), generator=g).float()
    w[11] = torch.randint(-127, 128, (cols,), generator=g).float() / 127
    w[12] = 1.27e-10 * torch.sign(torch.randn(cols, generator=g))
    return w


INPUTS = {
    "randn": lambda: torch.randn(16, 128, generator=torch.Generator().manual_seed(1)),
    "edge": edge_weights,
    "bf16": lambda: edge_weights(seed=2).to(torch.bfloat16),
    "fp16": lambda: (edge_weights(seed=3) * 10).to(torch.float16),
}


# -- callers bit-identical to their old formulas -------------------------------------------------------------
@pytest.mark.parametrize("name", INPUTS)
@pytest.mark.parametrize("group", [32, 128], ids=lambda g: f"g{g}")
@pytest.mark.parametrize("mode", ["int", "float", "symmetric"])
def test_int4_grouped_unchanged(name, group, mode):
    w = INPUTS[name]()
    sym = mode == "symmetric"
    zp = "int" if sym else mode
    assert_bitwise(quantize_int4_grouped(w, group, sym, zp), old_quantize_int4_grouped(w, group, sym, zp))


@pytest.mark.parametrize("name", INPUTS)
def test_int4_layer_and_packing_unchanged(name):
    codes, scales, zeros = quantize_int4_grouped(INPUTS[name](), 32)
    assert_bitwise(int4_pack_int4(codes), old_int4_pack(codes))
    assert_bitwise(int4_unpack_int4(old_int4_pack(codes)), old_int4_unpack(old_int4_pack(codes)))
    assert_bitwise(pack_int4(codes.to(torch.int32), order="high_first"), old_tinygemm_pairs(codes))
    layer = Int4Linear.from_codes(codes, scales, zeros, group_size=32, layout="plain")
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4))
    for dtype in (torch.float32, torch.bfloat16):
        w = old_int4_plain_weight(layer.qweight, layer.scales, layer.zeros, 32, dtype)
        assert_bitwise(layer(x.to(dtype)), torch.nn.functional.linear(x.to(dtype), w))
    assert_bitwise(layer.dequantize(), old_int4_plain_weight(layer.qweight, layer.scales, layer.zeros, 32, torch.float32))


@pytest.mark.parametrize("name", INPUTS)
@pytest.mark.parametrize("group", [None, 32], ids=["per-row", "g32"])
def test_int8_unchanged(name, group):
    w = INPUTS[name]()
    q, s = quantize_int8_per_channel(w, group)
    assert_bitwise((q, s), old_quantize_int8_per_channel(w, group))
    layer = Int8Linear.from_codes(q, s)
    old = q.float() * (s[:, None] if group is None else s.repeat_interleave(group, 1))
    assert_bitwise(layer.dequantize(), old)


@pytest.mark.parametrize("name", INPUTS)
def test_w8a8_unchanged(name):
    x = INPUTS[name]()
    assert_bitwise(quantize_per_token(x), old_quantize_per_token(x))
    layer = W8A8Linear.from_weight(x.float())
    q, s = old_quantize_int8_per_channel(x.float())
    assert_bitwise((layer.weight_int8, layer.weight_scale), (q, s))
    assert_bitwise(layer.dequantize(), q.float() * s[:, None])


@pytest.mark.parametrize("name", INPUTS)
@pytest.mark.parametrize("bits, symmetric", [(4, False), (4, True), (8, False)], ids=["int4", "int4-sym", "int8"])
def test_grid_unchanged(name, bits, symmetric):
    w = INPUTS[name]().float()
    new, old = Grid(bits, symmetric), OldGrid(bits, symmetric)
    assert_bitwise(new.fit(w.reshape(16, 4, 32)), old.fit(w.reshape(16, 4, 32)))
    assert_bitwise(new.fit(w[:, 5:37]), old.fit(w[:, 5:37]))  # a strided slice of columns, as GPTQ fits
    s, z = old.fit(w[:, 5:37])
    assert_bitwise(new.quantize(w[:, 7], s, z), old.quantize(w[:, 7], s, z))  # one column, as GPTQ rounds
    r = new.rtn(w, 32)
    assert_bitwise(r, old.rtn(w, 32))
    assert_bitwise(Grid.dequantize(*r, 32), OldGrid.dequantize(*r, 32))


@pytest.mark.skipif(fp8_dtype() is None, reason="torch without float8_e4m3fn")
@pytest.mark.parametrize("name", INPUTS)
@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_fp8_unchanged(name, granularity):
    x = INPUTS[name]()
    codes, scale = quantize_fp8(x, granularity)
    assert_bitwise((codes, scale), old_quantize_fp8(x, granularity))
    for dtype in (torch.float32, torch.bfloat16):
        assert_bitwise(dequantize_fp8(codes, scale, dtype), old_dequantize_fp8(codes, scale, dtype))
    kv = x.float().reshape(2, 2, 4, 128)  # the fp8 KV cache: [B, H, T, D], a scale per token
    assert_bitwise(quantize_fp8(kv), old_quantize_fp8(kv))
    layer = FP8Linear.from_float(nn.Linear(128, 16).requires_grad_(False), granularity=granularity)
    s = layer.weight_scale[:, None] if granularity == "row" else layer.weight_scale
    assert_bitwise(layer.dequantize(), old_dequantize_fp8(layer.weight_fp8, s))


@pytest.mark.parametrize("bits", [8, 4], ids=["int8", "int4"])
@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_kv_groups_unchanged(bits, axis, scale_dtype):
    x = edge_weights(rows=64, cols=32, seed=5).reshape(2, 2, 16, 32) * 3 + 1  # [B, H, T, D]
    x[0, 0, :, 0] = 2.0  # a constant channel
    x[0, 1, 0, :] = -1.0  # a constant token
    new = quantize_groups(x, bits, 8, axis, scale_dtype)
    assert_bitwise(new, old_quantize_groups(x, bits, 8, axis, scale_dtype))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert_bitwise(dequantize_groups(*new, bits, 8, axis, dtype), old_dequantize_groups(*new, bits, 8, axis, dtype))
    q = torch.randint(0, 16, (2, 3, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert_bitwise(kv_pack_int4(q), old_kv_pack(q))
    assert_bitwise(kv_unpack_int4(old_kv_pack(q)), old_kv_unpack(old_kv_pack(q)))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), groups=st.integers(1, 4), group=st.sampled_from([2, 8, 32]), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1e-12, 1e-6, 1.0, 1e4]), offset=st.sampled_from([0.0, 3.0, -50.0]))
def test_weight_callers_unchanged_on_random_inputs(rows, groups, group, seed, scale, offset):
    w = torch.randn(rows, groups * group, generator=torch.Generator().manual_seed(seed)) * scale + offset
    for sym, zp in ((False, "int"), (False, "float"), (True, "int")):
        assert_bitwise(quantize_int4_grouped(w, group, sym, zp), old_quantize_int4_grouped(w, group, sym, zp))
    for gs in (None, group):
        assert_bitwise(quantize_int8_per_channel(w, gs), old_quantize_int8_per_channel(w, gs))
    assert_bitwise(quantize_per_token(w), old_quantize_per_token(w))
    for bits, sym in ((4, False), (4, True), (8, False)):
        assert_bitwise(Grid(bits, sym).rtn(w, group), OldGrid(bits, sym).rtn(w, group))


def test_explicit_values():
    # small cases worked by hand: they hold whatever the formulas' code looks like
    w = torch.tensor([[-1.0, 0.0, 2.0, 6.5]])
    codes, scale, zero = quantize_int4_grouped(w, 4)
    assert codes.tolist() == [[0, 2, 6, 15]] and scale.tolist() == [[0.5]] and zero.tolist() == [[2.0]]
    q, s = quantize_int8_per_channel(torch.tensor([[1.0, -2.0], [0.5, 0.25]]))
    assert q.tolist() == [[64, -127], [127, 64]]  # 63.5 rounds half to even
    q, s = quantize_per_token(torch.tensor([[0.0, 0.0], [254.0, -127.0]]))
    assert q.tolist() == [[0, 0], [127, -64]] and s.flatten().tolist() == [pytest.approx(1e-12 / 127), 2.0]
    codes, scale, zero = quantize_groups(torch.tensor([[[[0.0], [1.0], [2.0], [3.0]]]]), 8, 4, "channel")
    assert codes.flatten().tolist() == [0, 85, 170, 255] and zero.flatten().tolist() == [0.0]


# -- properties of the primitives ------------------------------------------------------------------------------
RANGES = {  # name: (qmin, qmax, symmetric, zero_domain)
    "int4-int": (0, 15, False, "int"),
    "int4-float": (0, 15, False, "float"),
    "int4-value": (0, 15, False, "value"),
    "int8-value": (0, 255, False, "value"),
    "int4-sym": (0, 15, True, "int"),
    "uint8-sym": (0, 254, True, "int"),
    "int8-sym": (-127, 127, True, "int"),
    "int4-signed-int": (-8, 7, False, "int"),
}


@st.composite
def blocked_tensors(draw):
    """(x, block_size): 1-3 dims, each dimension a number of blocks times a block size."""
    ndim = draw(st.integers(1, 3))
    blocks = [draw(st.integers(1, 3)) for _ in range(ndim)]
    sizes = [draw(st.sampled_from([1, 2, 4])) for _ in range(ndim)]
    shape = [n * b for n, b in zip(blocks, sizes, strict=True)]
    seed = draw(st.integers(0, 2**16))
    spread = draw(st.sampled_from([1e-3, 1.0, 100.0]))
    offset = draw(st.sampled_from([0.0, 1.0, -20.0]))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * spread + offset
    if draw(st.booleans()):
        x[(0,) * ndim] = 0.0
    return x, tuple(sizes)


def per_element(p, x, block):
    """A scale/zero of the grid shape repeated over each block, shaped like ``x``."""
    for d, b in enumerate(block):
        p = p.repeat_interleave(b, dim=d)
    return p


@settings(max_examples=150, deadline=None)
@given(data=blocked_tensors(), name=st.sampled_from(sorted(RANGES)))
def test_round_trip_within_half_a_step(data, name):
    x, block = data
    qmin, qmax, sym, domain = RANGES[name]
    scale, zero = choose_qparams(x, block, qmin=qmin, qmax=qmax, symmetric=sym, zero_domain=domain,
                                 eps=None if domain == "value" else 1e-8)
    grid = tuple(n // b for n, b in zip(x.shape, block, strict=True))
    assert scale.shape == grid and (zero is None or zero.shape == grid)
    codes = quantize(x, block, scale, zero, qmin=qmin, qmax=qmax, zero_domain=domain, dtype=torch.int32)
    assert codes.shape == x.shape and int(codes.min()) >= qmin and int(codes.max()) <= qmax
    y = dequantize(codes, block, scale, zero, zero_domain=domain)
    step = per_element(scale, x, block)
    # each element within half a step of its group's grid (fp32 rounding aside)
    assert bool(((y - x).abs() <= step / 2 * 1.0001 + 1e-6 * (x.abs() + 1)).all())


@settings(max_examples=100, deadline=None)
@given(data=blocked_tensors(), bits=st.sampled_from([4, 8]))
def test_dequantize_error_per_group_at_most_half_its_scale(data, bits):
    x, block = data
    qmax = (1 << bits) - 1
    scale, zero = choose_qparams(x, block, qmin=0, qmax=qmax, symmetric=False, zero_domain="float", eps=1e-8)
    y = dequantize(quantize(x, block, scale, zero, qmin=0, qmax=qmax), block, scale, zero)
    err = (y - x).abs()
    for d, b in enumerate(block):  # the worst element of each group: [grid]
        err = err.unflatten(d, (-1, b)).amax(dim=d + 1)
    assert bool((err <= scale / 2 * 1.0001 + 1e-6 * (x.abs().max() + 1)).all())


@settings(max_examples=100, deadline=None)
@given(data=blocked_tensors(), bits=st.sampled_from([4, 8]))
def test_symmetric_codes_in_range_and_odd(data, bits):
    x, block = data
    qmax = (1 << (bits - 1)) - 1
    scale, zero = choose_qparams(x, block, qmin=-qmax, qmax=qmax, symmetric=True, min_range=1e-12)
    assert zero is None  # a signed symmetric range has no zero point
    codes = quantize(x, block, scale, qmin=-qmax, qmax=qmax, dtype=torch.int8)
    assert int(codes.abs().max()) <= qmax
    assert torch.equal(quantize(-x, block, scale, qmin=-qmax, qmax=qmax, dtype=torch.int8), -codes)
    # every block's largest magnitude lands on the end of the range
    top = codes.abs()
    for d, b in enumerate(block):
        top = top.unflatten(d, (-1, b)).amax(dim=d + 1)
    assert bool(((top == qmax) | (scale <= 1e-12 / qmax * 1.0001)).all())


@settings(max_examples=100, deadline=None)
@given(data=blocked_tensors(), qrange=st.sampled_from([(0, 15), (0, 255), (-8, 7)]))
def test_integer_zero_point_in_range(data, qrange):
    x, block = data
    qmin, qmax = qrange
    _, zero = choose_qparams(x, block, qmin=qmin, qmax=qmax, symmetric=False, zero_domain="int", eps=1e-8)
    assert torch.equal(zero, zero.round()) and int(zero.min()) >= qmin and int(zero.max()) <= qmax
    # 0.0 is on the grid: it quantizes and dequantizes exactly
    scale, zero = choose_qparams(x, block, qmin=qmin, qmax=qmax, symmetric=False, zero_domain="int", eps=1e-8)
    zeros = torch.zeros_like(x)
    codes = quantize(zeros, block, scale, zero, qmin=qmin, qmax=qmax, dtype=torch.int32)
    assert torch.equal(dequantize(codes, block, scale, zero), zeros)


@pytest.mark.parametrize("qrange, mid", [((0, 15), 8), ((0, 254), 127), ((-127, 127), None)])
def test_symmetric_zero_is_the_middle_code(qrange, mid):
    _, zero = choose_qparams(torch.randn(4, 8), (1, 8), qmin=qrange[0], qmax=qrange[1], symmetric=True)
    assert (zero is None) if mid is None else bool((zero == mid).all())


@settings(max_examples=80, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), dim_seed=st.integers(0, 3),
       order=st.sampled_from(["low_first", "high_first"]), seed=st.integers(0, 2**16))
def test_pack_unpack_identity(shape, dim_seed, order, seed):
    dim = dim_seed % len(shape)
    shape[dim] *= 2  # any shape with an even size along the packed dimension
    codes = torch.randint(0, 16, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack_int4(codes, dim=dim, order=order)
    half = list(shape)
    half[dim] //= 2
    assert packed.dtype == torch.uint8 and list(packed.shape) == half and packed.is_contiguous()
    assert torch.equal(unpack_int4(packed, dim=dim, order=order), codes)
    assert torch.equal(unpack_int4(packed, dim=dim - len(shape), order=order), codes)  # negative dims alike


def test_pack_orders_differ_by_nibble_swap():
    c = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_int4(c).tolist() == [[0x21, 0x0F]]
    assert pack_int4(c, order="high_first").tolist() == [[0x12, 0xF0]]


def test_bad_arguments_raise():
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match="does not tile"):
        choose_qparams(x, (1, 4), qmin=0, qmax=15, symmetric=False)
    with pytest.raises(ValueError, match="does not tile"):
        quantize(x, (6,), torch.ones(4), qmin=0, qmax=15)
    with pytest.raises(ValueError, match="zero_domain"):
        choose_qparams(x, (1, 6), qmin=0, qmax=15, symmetric=False, zero_domain="fp")
    with pytest.raises(ValueError, match="symmetric"):
        choose_qparams(x, (1, 6), qmin=0, qmax=15, symmetric=True, zero_domain="value")
    with pytest.raises(ValueError, match="does not match the block grid"):
        dequantize(x, (1, 3), torch.ones(4, 3))
    with pytest.raises(ValueError, match="even size"):
        pack_int4(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="order"):
        pack_int4(torch.zeros(2, 4, dtype=torch.uint8), order="middle")
    with pytest.raises(ValueError, match="does not divide"):
        group_block((4, 6), 4)


def test_constant_block_without_floor_is_exact():
    x = torch.full((2, 8), -3.25)
    scale, zero = choose_qparams(x, (1, 8), qmin=0, qmax=15, symmetric=False, zero_domain="value")
    assert bool((scale == 0).all())
    codes = quantize(x, (1, 8), scale, zero, qmin=0, qmax=15, zero_domain="value")
    assert bool((codes == 0).all()) and torch.equal(dequantize(codes, (1, 8), scale, zero, zero_domain="value"), x)


def test_primitives_import_only_torch():
    tree = ast.parse(Path(primitives.__file__).read_text())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert roots <= {"torch", "math", "collections", "__future__"}, roots
    assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree))


@pytest.mark.parametrize("name", INPUTS)
def test_w8a8_fast_path_equals_the_primitives(name):
    """quantize_per_token writes the per-row case out for speed; it must give the primitives' bits."""
    x = INPUTS[name]().float()
    block = (1, x.shape[-1])
    scale, _ = choose_qparams(x, block, qmin=-127, qmax=127, symmetric=True, min_range=1e-12)
    assert_bitwise(quantize_per_token(x), (quantize(x, block, scale, qmin=-127, qmax=127, dtype=torch.int8), scale))
