"""Int4/int8 weights x int8 dynamic activations: the C++ kernels against their torch reference (the oracle), the
block layouts, the layers built on them, and the compile pass that fuses shared-input calls."""

import copy
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import infopt
from infopt.core.errors import IncompatibleModelError, RecipeError
from infopt.models import tiny_model
from infopt.ops import cpp
from infopt.quantize import Int4WeightOnly, Int8WeightOnly, quantize_
from infopt.quantize.formats import a8
from infopt.quantize.formats.int4 import Int4Linear, quantize_int4_grouped
from infopt.quantize.formats.int8 import Int8Linear
from tests.fresh_thread import in_fresh_thread

kernel = pytest.mark.skipif(not a8.available(), reason="the C++ quant_linear kernel cannot be built here")


def _int4(n, k, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    codes, scales, zeros = quantize_int4_grouped(w, group, zero_point="float")
    return codes, scales, zeros


def _pack(n: int, k: int, group: int, seed: int, sym: bool):
    codes, scales, zeros = _int4(n, k, group, seed)
    return a8.pack_blocked_int4_sym(codes, scales) if sym else a8.pack_blocked_int4(codes, scales, zeros)


def _k_scales(n: int, k: int, seed: int, dead: bool = False):
    """Q4_K-like two-level scales (``pack_k_scales``) and codes for an ``[n, k]`` weight; ``dead``: some groups with
    sc 0 and one super-block with d 0 (a group that is its minimum whatever its codes)."""
    g = torch.Generator().manual_seed(seed)
    groups = k // 32
    d = (torch.rand(n, groups // 8, generator=g) / 50).half()
    dmin = (torch.rand(n, groups // 8, generator=g) / 100).half()
    sc = torch.randint(0, 64, (n, groups), generator=g)
    m = torch.randint(0, 64, (n, groups), generator=g)
    if dead:
        sc[::3, 1] = 0
        d[5, 0] = 0
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    weight, _ = a8.pack_blocked_int4(codes, torch.ones(n, 1), torch.zeros(n, 1))
    return weight, a8.pack_k_scales(d, dmin, sc, m)


def _float_weight(weight, scale_min):
    codes, scales, zeros = a8.unpack_blocked_int4(weight, scale_min)
    group = codes.shape[1] // scales.shape[1]
    return (codes.float() - zeros.repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)


def _sqnr_db(got, want):
    return float(10 * torch.log10(want.pow(2).sum() / (got - want).pow(2).sum()))


# -- layouts ------------------------------------------------------------------------------------------------------

def test_int4_layout_round_trips_codes_and_rounds_scales_to_bf16():
    codes, scales, zeros = _int4(48, 128, 32)
    weight, sm = a8.pack_blocked_int4(codes, scales, zeros)
    assert weight.shape == (3, 16, 64) and weight.dtype == torch.uint8
    assert sm.shape == (3, 4, 2, 16) and sm.dtype == torch.bfloat16
    c2, s2, z2 = a8.unpack_blocked_int4(weight, sm)
    assert torch.equal(c2, codes)
    assert torch.equal(s2, scales.to(torch.bfloat16).float())
    # the minimum is -zero * scale in bf16: the recovered zero point gives back the same minimum
    torch.testing.assert_close((-z2 * s2).to(torch.bfloat16), (-zeros * s2).to(torch.bfloat16), rtol=0, atol=0)
    # byte 4r + j of chunk c of block b: row 16b + r, columns 8c + j (low nibble) and 8c + 4 + j (high)
    b, c, r, j = 2, 5, 7, 3
    byte = int(weight[b, c, 4 * r + j])
    assert byte & 0xF == codes[16 * b + r, 8 * c + j] and byte >> 4 == codes[16 * b + r, 8 * c + 4 + j]


def test_int8_layout_round_trips_with_codes_biased():
    codes = torch.randint(-128, 128, (32, 64), dtype=torch.int8)
    weight = a8.pack_blocked_int8(codes)
    assert weight.shape == (2, 16, 64) and weight.dtype == torch.uint8
    assert torch.equal(a8.unpack_blocked_int8(weight), codes)
    # byte 4r + j of chunk c of block b: row 16b + r, column 4c + j, code + 128
    b, c, r, j = 1, 5, 7, 2
    assert int(weight[b, c, 4 * r + j]) == int(codes[16 * b + r, 4 * c + j]) + 128


def test_layouts_need_rows_in_blocks_of_16():
    with pytest.raises(ValueError, match="out_features divisible by 16, got 40"):
        a8.pack_blocked_int4(*_int4(40, 64, 32))


def test_activation_codes_round_half_to_even_and_keep_zero_groups_zero():
    x = torch.tensor([[127.0, 0.5, -0.5, 1.5, 0.0, 0.0, 0.0, 0.0]])
    q, s = a8.quantize_activations(x, 4)
    assert q.tolist() == [[127, 0, 0, 2, 0, 0, 0, 0]] and s.tolist() == [[1.0, 0.0]]


# -- kernels against the reference ----------------------------------------------------------------------------------

@kernel
@settings(max_examples=40, deadline=None)
@given(blocks=st.integers(1, 5), group=st.sampled_from([32, 64, 128, 256]), groups=st.integers(1, 3),
       rows=st.integers(1, 9), bf16=st.booleans(), seed=st.integers(0, 2**16), sym=st.booleans())
def test_int4_kernel_matches_the_reference(blocks, group, groups, rows, bf16, seed, sym):
    """Both scale forms: bf16 scales and minimums, and the symmetric layout's fp16 scales alone (``a8_sym``)."""
    n, k = 16 * blocks, group * groups
    weight, sm = _pack(n, k, group, seed, sym)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 1))
    if bf16:
        x = x.to(torch.bfloat16)
    got = torch.ops.infopt.int4_a8_linear(x, weight, sm, group)
    want = a8.int4_a8_reference(x.float(), weight, sm, group)
    assert got.dtype == x.dtype and got.shape == (rows, n)
    # the integer products are exact; only the float sums' order differs (and the bf16 output's rounding)
    tol = 8e-3 if bf16 else 2e-6
    assert (got.float() - want).abs().max() <= tol * want.abs().max()


@kernel
@settings(max_examples=30, deadline=None)
@given(blocks=st.integers(1, 4), supers=st.integers(1, 3), rows=st.integers(1, 9), bf16=st.booleans(),
       seed=st.integers(0, 2**16))
def test_int4_kernel_on_q4_k_scales_is_the_fp32_scales_product_bit_for_bit(blocks, supers, rows, bf16, seed):
    """The a8_k layout's two-level scales: the kernel computes d * sc and -dmin * m in fp32 (exact) per block, so the
    product is the one over those fp32 scales, bit for bit, and the reference's within the sums' order."""
    n, k = 16 * blocks, 256 * supers
    weight, sk = _k_scales(n, k, seed, dead=blocks > 1)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 1))
    if bf16:
        x = x.to(torch.bfloat16)
    got = torch.ops.infopt.int4_a8_linear(x, weight, sk, 32)
    assert torch.equal(got, torch.ops.infopt.int4_a8_linear(x, weight, a8.k_scale_min(sk), 32))
    want = a8.int4_a8_reference(x.float(), weight, sk, 32)
    tol = 8e-3 if bf16 else 2e-6
    assert (got.float() - want).abs().max() <= tol * want.abs().max()
    fused = torch.ops.infopt.int4_a8_linear_n(x, [weight, weight], [sk, a8.k_scale_min(sk).to(torch.bfloat16)], 32)
    assert torch.equal(fused[0], got)  # forms mix in one fused call
    assert torch.equal(fused[1], torch.ops.infopt.int4_a8_linear(x, weight, a8.k_scale_min(sk).to(torch.bfloat16), 32))


@kernel
@settings(max_examples=40, deadline=None)
@given(blocks=st.integers(1, 5), k=st.sampled_from([32, 64, 96, 576]), rows=st.integers(1, 9),
       group=st.sampled_from([16, 32]), per_scale=st.sampled_from([0, 1, 2, 3]), seed=st.integers(0, 2**16))
def test_int8_kernel_matches_the_reference(blocks, k, rows, group, per_scale, seed):
    """Per-row scales (``per_scale`` 0) or one per row and group of ``per_scale`` activation groups (a GGUF file's
    Q8_0 / Q6_K blocks), every row count the kernel passes over (1-4 at a time)."""
    n = 16 * blocks
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    groups = k // group
    if per_scale and groups % per_scale:
        per_scale = 1
    scale = torch.rand(n, generator=g) * 0.02 if not per_scale else \
        a8.block_scales(torch.rand(n, groups // per_scale, generator=g) * 0.02)
    weight = a8.pack_blocked_int8(codes)
    x = torch.randn(rows, k, generator=g) * 3
    got = torch.ops.infopt.int8_a8_linear(x, weight, scale, group)
    want = a8.int8_a8_reference(x, weight, scale, group)
    assert (got - want).abs().max() <= 2e-6 * want.abs().max()


@kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_quantizes_activations_exactly_as_the_reference(dtype):
    """Through an identity int8 weight (scale 1) the kernel's output is code * scale: its codes must equal the
    reference's one for one (a 1-ulp difference in 127 / absmax moves a code at a tie)."""
    k = 64
    eye = a8.pack_blocked_int8(torch.eye(k, dtype=torch.int8))
    x = (torch.randn(4096, k, generator=torch.Generator().manual_seed(3)) * 5).to(dtype)
    y = torch.ops.infopt.int8_a8_linear(x, eye, torch.ones(k), 16).float()
    q, s = a8.quantize_activations(x, 16)
    # the output is code * scale rounded to x's dtype: bit-equal to the reference's codes times their scales
    want = (q.float() * s.repeat_interleave(16, 1)).to(dtype).float()
    torch.testing.assert_close(y, want, rtol=0, atol=0)


@kernel
@pytest.mark.parametrize("shape", [(576, 576), (192, 576), (1536, 576), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_int4_kernel_sqnr_floor_against_the_float_weight(shape, rows):
    """Activation quantization's loss alone (the weight's own is not counted): above 38 dB on Gaussian inputs."""
    n, k = shape
    weight, sm = a8.pack_blocked_int4(*_int4(n, k, 32))
    x = torch.randn(rows, k)
    before = a8.kernel_calls()["int4_a8_linear"]
    got = a8.int4_a8_linear(x, weight, sm, 32)
    assert a8.kernel_calls()["int4_a8_linear"] == before + 1  # the C++ kernel, not its reference
    assert _sqnr_db(got, x @ _float_weight(weight, sm).t()) > 38


@kernel
def test_fused_call_is_bit_identical_to_separate_calls():
    parts = [a8.pack_blocked_int4(*_int4(n, 576, 32, seed=n)) for n in (576, 192, 192)]
    before = a8.kernel_calls()
    for rows in (1, 3, 17):
        x = torch.randn(rows, 576)
        fused = a8.int4_a8_linear_n(x, [w for w, _ in parts], [s for _, s in parts], 32)
        for (w, s), y in zip(parts, fused, strict=True):
            assert torch.equal(y, a8.int4_a8_linear(x, w, s, 32))
    # both sides ran the C++ operators (their references would agree bit for bit as well)
    calls = {k: v - before[k] for k, v in a8.kernel_calls().items()}
    assert (calls["int4_a8_linear_n"], calls["int4_a8_linear"], calls["reference"]) == (3, 9, 0)


@kernel
def test_kernels_refuse_bad_inputs_with_the_reason():
    weight, sm = a8.pack_blocked_int4(*_int4(32, 64, 32))
    with pytest.raises(RuntimeError, match="x has 32 input features, the weight 64"):
        torch.ops.infopt.int4_a8_linear(torch.randn(1, 32), weight, sm, 32)
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        torch.ops.infopt.int4_a8_linear(torch.randn(1, 64, dtype=torch.float64), weight, sm, 32)
    with pytest.raises(RuntimeError, match=r"scale_min must be contiguous bfloat16 or float32 \[2, 1, 2, 16\]"):
        torch.ops.infopt.int4_a8_linear(torch.randn(1, 64), weight, sm, 64)
    _, sk = _k_scales(32, 256, 0)
    with pytest.raises(RuntimeError, match=r"or uint8 \[NB, G/8, 320\] \(Q4_K scales, G a multiple of 8\)"):
        torch.ops.infopt.int4_a8_linear(torch.randn(1, 64), weight, sk, 32)
    with pytest.raises(RuntimeError, match=r"weight must be contiguous uint8 \[out/16, in/4, 64\] \(codes \+ 128\)"):
        torch.ops.infopt.int8_a8_linear(torch.randn(1, 64), weight.view(torch.int8), torch.ones(32), 32)
    w8 = a8.pack_blocked_int8(torch.zeros(32, 64, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="scale's 3 groups per row must each span a whole number of the 4 "):
        torch.ops.infopt.int8_a8_linear(torch.randn(1, 64), w8, torch.ones(2, 3, 16), 16)
    with pytest.raises(RuntimeError, match=r"scale must be contiguous float32 \[32\] or blocked \[2, groups, 16\]"):
        torch.ops.infopt.int8_a8_linear(torch.randn(1, 64), w8, torch.ones(32, 4), 16)


_PORTABLE_CHECK = textwrap.dedent("""
    import sys, torch
    torch.ops.load_library(sys.argv[1])
    from infopt.quantize.formats import a8
    from infopt.quantize.formats.int4 import quantize_int4_grouped
    torch.manual_seed(0)
    w, sm = a8.pack_blocked_int4(*quantize_int4_grouped(torch.randn(48, 128), 32, zero_point="float"))
    c4, s4, _ = quantize_int4_grouped(torch.randn(48, 128), 32, symmetric=True)
    ws4, sm16 = a8.pack_blocked_int4_sym(c4, s4)  # the a8_sym layout: fp16 scales alone
    codes = torch.randint(-128, 128, (48, 128), dtype=torch.int8)
    w8 = a8.pack_blocked_int8(codes)
    scale = torch.rand(48)
    for rows in (1, 5):
        x = torch.randn(rows, 128)
        y, r = torch.ops.infopt.int4_a8_linear(x, w, sm, 32), a8.int4_a8_reference(x, w, sm, 32)
        assert (y - r).abs().max() <= 2e-6 * r.abs().max(), "int4"
        y, r = torch.ops.infopt.int4_a8_linear(x, ws4, sm16, 32), a8.int4_a8_reference(x, ws4, sm16, 32)
        assert (y - r).abs().max() <= 2e-6 * r.abs().max(), "int4, fp16 scales alone"
        y, r = torch.ops.infopt.int8_a8_linear(x, w8, scale, 32), a8.int8_a8_reference(x, w8, scale, 32)
        assert (y - r).abs().max() <= 2e-6 * r.abs().max(), "int8"
        gs = a8.block_scales(torch.rand(48, 4) + 0.1)  # group scales over whole activation groups (16, 32 columns)
        for group in (16, 32):
            y = torch.ops.infopt.int8_a8_linear(x, w8, gs, group)
            r = a8.int8_a8_reference(x, w8, gs, group)
            assert (y - r).abs().max() <= 2e-6 * r.abs().max(), f"int8 group scales, activation group {group}"
    ck = torch.randint(0, 16, (48, 256), dtype=torch.uint8)
    wk, _ = a8.pack_blocked_int4(ck, torch.ones(48, 1), torch.zeros(48, 1))
    sk = a8.pack_k_scales((torch.rand(48, 1) / 50).half(), (torch.rand(48, 1) / 100).half(),
                          torch.randint(0, 64, (48, 8)), torch.randint(0, 64, (48, 8)))  # Q4_K's two-level scales
    for rows in (1, 5):
        x = torch.randn(rows, 256)
        y, r = torch.ops.infopt.int4_a8_linear(x, wk, sk, 32), a8.int4_a8_reference(x, wk, sk, 32)
        assert (y - r).abs().max() <= 2e-6 * r.abs().max(), "int4, Q4_K scales"
        assert torch.equal(y, torch.ops.infopt.int4_a8_linear(x, wk, a8.k_scale_min(sk), 32)), "int4, fp32 scales"
    w6 = a8.pack_blocked_int8(torch.randint(-32, 32, (48, 256), dtype=torch.int8))
    k6 = a8.pack_k6_scales((torch.rand(48, 1) / 100).half(), torch.randint(-128, 128, (48, 16)))  # Q6_K's scales
    for rows in (1, 5):
        x = torch.randn(rows, 256)
        y, r = torch.ops.infopt.int8_a8_linear(x, w6, k6, 16), a8.int8_a8_reference(x, w6, k6, 16)
        assert (y - r).abs().max() <= 2e-6 * r.abs().max(), "int8, Q6_K scales"
        assert torch.equal(y, torch.ops.infopt.int8_a8_linear(x, w6, a8.k6_block_scales(k6), 16)), "int8, fp32"
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(torch.ops.infopt.int4_a8_dense_t(w, sm, 32, dtype),
                           a8.int4_dense_t_reference(w, sm, 32, dtype)), "dense"
        assert torch.equal(torch.ops.infopt.int4_a8_dense_t(ws4, sm16, 32, dtype),
                           a8.int4_dense_t_reference(ws4, sm16, 32, dtype)), "dense, fp16 scales alone"
        assert torch.equal(torch.ops.infopt.int4_a8_dense_t(wk, sk, 32, dtype),
                           a8.int4_dense_t_reference(wk, sk, 32, dtype)), "dense, Q4_K scales"
    print(torch.ops.infopt.quant_linear_isa())
""")


@pytest.mark.slow
@pytest.mark.skipif(cpp._compiler() is None or os.uname().machine != "x86_64", reason="needs g++ on x86-64")
@pytest.mark.parametrize(("march", "isa"), [("x86-64-v3", "avx2"), ("x86-64", "portable")])
def test_portable_builds_match_the_reference(tmp_path, march, isa):
    """The AVX2 and plain C++ paths (for CPUs without VNNI), built here with an older -march, in a subprocess (a
    second registration of the operators in this process would abort it)."""
    cmd = [a if a != "-march=native" else f"-march={march}"
           for a in cpp._command(cpp._compiler(), cpp._SRC / "quant_linear.cpp", tmp_path / "k.so")]
    subprocess.run(cmd, check=True, capture_output=True)
    out = subprocess.run([sys.executable, "-c", _PORTABLE_CHECK, str(tmp_path / "k.so")], capture_output=True,
                         text=True, env={**os.environ, "INFOPT_NO_EXTENSIONS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == isa


def test_reference_runs_where_the_kernel_is_not_available(monkeypatch):
    weight, sm = a8.pack_blocked_int4(*_int4(32, 64, 32))
    x = torch.randn(2, 64)
    monkeypatch.setitem(cpp._STATE, "quant_linear", "off for this test")
    assert a8.isa() is None
    torch.testing.assert_close(a8.int4_a8_linear(x, weight, sm, 32), a8.int4_a8_reference(x, weight, sm, 32))
    assert torch.equal(a8.int4_dense_t(weight, sm, 32), a8.int4_dense_t_reference(weight, sm, 32))


# -- the prompt path: weights dequantized on the fly ----------------------------------------------------------------

@kernel
@settings(max_examples=30, deadline=None)
@given(blocks=st.integers(1, 6), group=st.sampled_from([32, 64, 128]), groups=st.integers(1, 3),
       bf16=st.booleans(), seed=st.integers(0, 2**16), sym=st.booleans())
def test_dense_copy_is_the_reference_bit_for_bit(blocks, group, groups, bf16, seed, sym):
    weight, sm = _pack(16 * blocks, group * groups, group, seed, sym)
    dtype = torch.bfloat16 if bf16 else torch.float32
    got = a8.int4_dense_t(weight, sm, group, dtype)
    assert got.dtype == dtype and got.shape == (group * groups, 16 * blocks) and got.is_contiguous()
    assert torch.equal(got, a8.int4_dense_t_reference(weight, sm, group, dtype))
    # into a kept buffer (a8.dense_scratch): the same bits, the buffer itself returned, whatever it held before
    out = a8.dense_scratch(group * groups, 16 * blocks, dtype).fill_(float("nan"))
    assert a8.int4_dense_t(weight, sm, group, dtype, out=out) is out and torch.equal(out, got)


def test_dense_scratch_is_one_buffer_per_thread_and_dtype_grown_to_the_largest():
    small = a8.dense_scratch(4, 8, torch.bfloat16)
    big = a8.dense_scratch(64, 64, torch.bfloat16)
    again = a8.dense_scratch(4, 8, torch.bfloat16)
    assert small.shape == again.shape == (4, 8) and big.shape == (64, 64)
    assert again.data_ptr() == big.data_ptr()  # the grown buffer serves the smaller size too
    assert a8.dense_scratch(4, 8, torch.float32).data_ptr() != again.data_ptr()
    seen = []
    worker = threading.Thread(target=lambda: seen.append(a8.dense_scratch(4, 8, torch.bfloat16).data_ptr()))
    worker.start()
    worker.join()
    assert seen[0] != again.data_ptr()
    with pytest.raises(ValueError, match="out is torch.float32"):
        a8.int4_dense_t(*a8.pack_blocked_int4(*_int4(16, 32, 32)), 32, torch.bfloat16,
                        out=torch.empty(32, 16))


def test_dense_copy_is_the_weight_the_integer_kernel_multiplies():
    # the fp32 copy is code * scale + min exactly (so the dequantized layer, within fp32 rounding)
    weight, sm = a8.pack_blocked_int4(*_int4(48, 128, 32))
    torch.testing.assert_close(a8.int4_dense_t(weight, sm, 32, torch.float32), _float_weight(weight, sm).t(),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_copy_of_q4_k_scales_is_the_fp32_scales_copy(dtype):
    weight, sk = _k_scales(32, 512, 3, dead=True)
    got = a8.int4_dense_t(weight, sk, 32, dtype)
    assert torch.equal(got, a8.int4_dense_t(weight, a8.k_scale_min(sk), 32, dtype))
    assert torch.equal(got, a8.int4_dense_t_reference(weight, sk, 32, dtype))


@kernel
def test_dense_copy_refuses_bad_inputs_with_the_reason():
    weight, sm = a8.pack_blocked_int4(*_int4(32, 64, 32))
    with pytest.raises(RuntimeError, match="dtype must be bfloat16 or float32"):
        torch.ops.infopt.int4_a8_dense_t(weight, sm, 32, torch.float16)
    with pytest.raises(RuntimeError, match=r"scale_min must be contiguous bfloat16 or float32 \[2, 1, 2, 16\]"):
        torch.ops.infopt.int4_a8_dense_t(weight, sm, 64, torch.float32)
    with pytest.raises(RuntimeError, match="must be a multiple of 8"):
        torch.ops.infopt.int4_a8_dense_t(weight, sm, 12, torch.float32)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_a8_layers_multiply_prompts_by_a_weight_dequantized_per_call(x_dtype, monkeypatch):
    from infopt.quantize.formats import int4

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32, bias=True)
    layer = Int4Linear.from_float(lin, group_size=32, layout="a8")
    assert layer.weight_dense is None
    kernel = lambda x: a8.int4_a8_linear(x, layer.weight_packed, layer.scale_min, 32) + layer.bias  # noqa: E731
    monkeypatch.setattr(int4, "_FAST_BF16", [True])
    x = torch.randn(int4.A8_PROMPT_MIN_ROWS + 3, 64, dtype=x_dtype)
    w_t = a8.int4_dense_t_reference(layer.weight_packed, layer.scale_min, 32)
    before = int4.kernel_calls()
    assert torch.equal(layer(x), torch.matmul(x.to(torch.bfloat16), w_t).to(x_dtype) + layer.bias)
    x = torch.randn(int4.A8_PROMPT_MIN_ROWS - 1, 64, dtype=x_dtype)  # fewer rows: the integer kernel
    assert torch.equal(layer(x), kernel(x))
    monkeypatch.setattr(int4, "_FAST_BF16", [False])  # without native bf16 GEMMs the kernel takes every row count
    x = torch.randn(int4.A8_PROMPT_MIN_ROWS + 3, 64, dtype=x_dtype)
    assert torch.equal(layer(x), kernel(x))
    assert {k: v - before[k] for k, v in int4.kernel_calls().items() if v != before[k]} == {"a8_prompt": 1, "a8": 2}


@kernel
def test_a8_prompts_through_the_kept_buffer_stay_right_layer_after_layer_and_under_autograd(monkeypatch):
    """Two layers of different shapes share the thread's dequantization buffer: each prompt's product is its own
    weight's; with autograd the product keeps its operand, so the layer takes a buffer of its own, and the gradient
    is the reference weight's."""
    from infopt.quantize.formats import int4

    monkeypatch.setattr(int4, "_FAST_BF16", [True])
    torch.manual_seed(1)
    first = Int4Linear.from_float(torch.nn.Linear(64, 96, bias=False), group_size=32, layout="a8")
    second = Int4Linear.from_float(torch.nn.Linear(96, 32, bias=False), group_size=32, layout="a8")
    want = {m: a8.int4_dense_t_reference(m.weight_packed, m.scale_min, 32) for m in (first, second)}
    x = torch.randn(int4.A8_PROMPT_MIN_ROWS, 64)
    with torch.no_grad():
        h = first(x)
        assert torch.equal(h, torch.matmul(x.bfloat16(), want[first]).float())
        assert torch.equal(second(h), torch.matmul(h.bfloat16(), want[second]).float())
        assert torch.equal(first(x), h)  # the buffer, rewritten by the second layer, rewritten again
    xg = x.clone().requires_grad_(True)
    y = first(xg)
    second(y.detach())  # another layer's prompt between the forward and the backward
    y.sum().backward()
    ref = x.clone().requires_grad_(True)
    torch.matmul(ref.bfloat16(), want[first]).float().sum().backward()
    assert torch.equal(xg.grad, ref.grad)


def test_a8_prompts_share_the_kept_buffer_in_and_out_of_inference_mode(monkeypatch):
    """A first prompt under ``torch.inference_mode`` (as serving code often runs) and a later one outside it (``no_grad``):
    the thread's buffer must stay writable by both, and each product is the reference one. In a new thread, whose
    buffer is new, so the first prompt is the one that makes it."""
    from infopt.quantize.formats import int4

    monkeypatch.setattr(int4, "_FAST_BF16", [True])
    torch.manual_seed(2)
    layer = Int4Linear.from_float(torch.nn.Linear(64, 96, bias=False), group_size=32, layout="a8")
    x = torch.randn(int4.A8_PROMPT_MIN_ROWS, 64)
    want = torch.matmul(x.bfloat16(), a8.int4_dense_t_reference(layer.weight_packed, layer.scale_min, 32)).float()

    def prompts():
        with torch.inference_mode():
            first = layer(x)
        # a normal tensor, so plain torch writes (not only the kernel's) work outside inference mode too
        normal = not a8.dense_scratch(64, 96, torch.bfloat16).is_inference()
        with torch.no_grad():
            second = layer(x)
        with torch.inference_mode():
            third = layer(x)
        return normal, [first, second, third]

    normal, got = in_fresh_thread(prompts)
    assert normal and all(torch.equal(g, want) for g in got)


# -- layers and recipes --------------------------------------------------------------------------------------------

def _a8_model(**kw):
    torch.manual_seed(0)
    m = tiny_model()
    return quantize_(m, Int4WeightOnly(group_size=32, activations="int8", include_lm_head=True, **kw))


def test_recipe_builds_a8_layers_and_an_int8_activation_head():
    m = _a8_model()
    assert m.model.layers[0].self_attn.q_proj.layout == "a8"
    assert isinstance(m.lm_head, Int8Linear) and m.lm_head.activations == "int8"
    ref = tiny_model()
    torch.manual_seed(0)
    ref = tiny_model()
    ids = torch.randint(0, ref.config.vocab_size, (2, 12))
    want = torch.log_softmax(ref(ids).logits.float(), -1)
    got = torch.log_softmax(m(ids).logits.float(), -1)
    kl = torch.nn.functional.kl_div(got, want, log_target=True, reduction="batchmean") / ids.shape[1]
    assert kl < 0.05  # a random tiny model: the check is that nothing is broken, the real model's figures are in docs


def test_bad_fields_are_refused():
    with pytest.raises(RecipeError, match="activations"):
        Int4WeightOnly(activations="int4")
    with pytest.raises(RecipeError, match="group_size"):
        Int8WeightOnly(activations="int8", group_size=0)


@kernel
def test_int8_activations_with_group_scales():
    """``Int8WeightOnly(activations="int8", group_size=32)``: a8 layers keeping their group scales, run by the
    integer kernel, within activation quantization's loss of the same codes with float activations; a group size
    that is not a whole number of activation groups is refused, naming the layer, with the model untouched."""
    ref = tiny_model()
    m = quantize_(copy.deepcopy(ref), Int8WeightOnly(activations="int8", group_size=32))
    up = m.model.layers[0].mlp.up_proj
    want = ("a8", 32, (up.out_features, up.in_features // 32))
    assert (up.layout, up.group_size, tuple(up.weight_scale.shape)) == want
    assert torch.equal(up.wscale, a8.block_scales(up.weight_scale))  # the kernel's blocked copy, kept in step
    assert "wscale" not in m.state_dict() and "model.layers.0.mlp.up_proj.wscale" not in m.state_dict()
    again = quantize_(tiny_model(), Int8WeightOnly(activations="int8", group_size=32))
    again.load_state_dict(m.state_dict())  # a load refreshes the copy from the loaded scales
    assert torch.equal(again.model.layers[0].mlp.up_proj.wscale, up.wscale)
    flt = quantize_(copy.deepcopy(ref), Int8WeightOnly(group_size=32, compute_dtype="float32"))
    x = torch.randn(3, up.in_features)
    before = a8.kernel_calls()["int8_a8_linear"]
    got = up(x)
    assert a8.kernel_calls()["int8_a8_linear"] == before + 1
    assert _sqnr_db(got, flt.model.layers[0].mlp.up_proj(x)) > 38
    ids = torch.randint(0, ref.config.vocab_size, (1, 10))
    assert torch.equal(m.generate(ids, max_new_tokens=6, do_sample=False)[:, :10], ids)
    bad = tiny_model()
    before_sd = {k: v.clone() for k, v in bad.state_dict().items()}
    with pytest.raises(IncompatibleModelError,
                       match=r"model\.layers\.0\..*multiple of the activation group, 16 .*got 8"):
        infopt.optimize(bad, [Int8WeightOnly(activations="int8", group_size=8)])
    assert all(torch.equal(v, before_sd[k]) for k, v in bad.state_dict().items())


@kernel
@pytest.mark.parametrize("rows", [1, 3, 6])
@pytest.mark.parametrize("bf16", [False, True])
def test_int8_kernel_on_q6_k_scales_is_the_fp32_scales_product_bit_for_bit(rows, bf16):
    """Q6_K's two-level scales (fp16 d per 256 inputs, int8 sc per 16): the kernel computes d * sc in fp32 (exact)
    per block, so the product is the one over the blocked fp32 scales, bit for bit."""
    g = torch.Generator().manual_seed(rows)
    n, k = 48, 512
    weight = a8.pack_blocked_int8(torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g))
    k6 = a8.pack_k6_scales((torch.rand(n, k // 256, generator=g) / 100).half(),
                           torch.randint(-128, 128, (n, k // 16), generator=g))
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16 if bf16 else torch.float32)
    got = torch.ops.infopt.int8_a8_linear(x, weight, k6, 16)
    assert torch.equal(got, torch.ops.infopt.int8_a8_linear(x, weight, a8.k6_block_scales(k6), 16))
    want = a8.int8_a8_reference(x.float(), weight, k6, 16)
    assert (got.float() - want).abs().max() <= (8e-3 if bf16 else 2e-6) * want.abs().max()


def test_int8_group_scales_per_16_that_factor_as_q6_k_are_held_in_that_form():
    """A group-16 a8 layer whose scales are an fp16 d per 256 inputs times an int8 sc (a GGUF Q6_K file's, however
    the layer was built) keeps them in that form for the kernel (0.56 bits a weight instead of 2), the same
    products; other scales stay blocked fp32."""
    from infopt.quantize.formats.int8_layouts import factor_k6_scales

    d = (torch.rand(32, 2) / 100).half()
    sc = torch.randint(-128, 128, (32, 32))
    sc[:, 0] = -128
    scales = d.float().repeat_interleave(16, 1) * sc.float()
    codes = torch.randint(-32, 32, (32, 512), dtype=torch.int8)
    layer = Int8Linear.from_codes(codes, scales, dtype=torch.float32, activations="int8")
    assert layer.group_size == 16 and layer.wscale.dtype == torch.uint8
    assert torch.equal(a8.k6_block_scales(layer.wscale), a8.block_scales(scales))
    got_d, got_sc = factor_k6_scales(scales)
    assert torch.equal(got_d, d) and torch.equal(got_sc, sc.float())
    other = Int8Linear.from_codes(codes, scales + 1e-7, dtype=torch.float32, activations="int8")
    assert other.wscale.dtype == torch.float32 and torch.equal(other.wscale, a8.block_scales(scales + 1e-7))
    x = torch.randn(2, 512)
    blocked = Int8Linear.from_codes(codes, scales, dtype=torch.float32, activations="int8")
    blocked.wscale = a8.block_scales(scales)
    assert torch.equal(layer(x), blocked(x))


def test_a8_layers_save_in_the_portable_layout_and_load_back_identically():
    m = _a8_model()
    sd = m.state_dict()
    assert {"model.layers.0.mlp.up_proj.qweight", "lm_head.weight_int8"} <= set(sd)
    assert not any(k.endswith(("weight_a8", "scale_min")) for k in sd)
    other = copy.deepcopy(m)
    torch.manual_seed(1)
    for mod in other.modules():  # scramble, then load
        if isinstance(mod, Int4Linear):
            mod._set_portable(None, torch.rand(mod.out_features, mod.in_features // 32) + 0.1,
                              torch.zeros(mod.out_features, mod.in_features // 32),
                              codes=torch.randint(0, 16, (mod.out_features, mod.in_features), dtype=torch.uint8))
    other.load_state_dict(sd)
    ids = torch.tensor([[5, 7, 9, 11]])
    assert torch.equal(other(ids).logits, m(ids).logits)
    # a float-activation layer reading the same codes computes the same weight (the layouts differ, not the values)
    q = m.model.layers[0].mlp.up_proj
    plain = Int4Linear(q.in_features, q.out_features, 32, bias=False, dtype=torch.float32, layout="plain")
    plain.load_state_dict(q.state_dict())
    torch.testing.assert_close(plain.dequantize(), q.dequantize())


def test_int8_head_state_dict_is_checked():
    head = Int8Linear.from_float(torch.nn.Linear(64, 32), activations="int8")
    fresh = Int8Linear(64, 32, bias=True, dtype=torch.float32, compute_dtype=None, activations="int8")
    fresh.load_state_dict(head.state_dict())
    x = torch.randn(3, 64)
    assert torch.equal(fresh(x), head(x))
    bad = dict(head.state_dict(), weight_int8=torch.zeros(32, 32, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="weight_int8: shape"):
        fresh.load_state_dict(bad)
    with pytest.raises(RuntimeError, match="Missing key"):
        fresh.load_state_dict({k: v for k, v in head.state_dict().items() if k != "weight_int8"})


@pytest.mark.parametrize("symmetric", [False, True])
def test_save_optimized_and_load_rebuild_a8_layers(tmp_path, symmetric):
    """Symmetric codes take the a8_sym layout (fp16 scales alone) and come back in it."""
    torch.manual_seed(0)
    m = tiny_model()
    recipe = [{"quantize": {"method": "int4", "group_size": 32, "include_lm_head": True, "activations": "int8",
                            "symmetric": symmetric}}]
    infopt.optimize(m, recipe)
    layout = "a8_sym" if symmetric else "a8"
    assert m.model.layers[1].mlp.down_proj.layout == layout
    infopt.save_optimized(m, tmp_path / "saved")
    loaded, _ = infopt.load(tmp_path / "saved")
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    down = loaded.model.layers[1].mlp.down_proj
    assert down.layout == layout and loaded.lm_head.activations == "int8"
    assert down.scale_min.dtype == (torch.float16 if symmetric else torch.bfloat16)
    assert torch.equal(loaded(ids).logits, m(ids).logits)


def test_q4_k_layout_round_trips_through_the_portable_form_exactly():
    """An a8_k layer's portable form (its state dict: codes, scales d * sc, zero points dmin * m / scale) factors back
    into the same two-level scales, dead groups (sc 0, and a super-block with d 0) included: a save and a reload
    multiply by the same weights. Scales that do not factor are refused with the reason."""
    weight, sk = _k_scales(32, 512, 7, dead=True)
    layer = Int4Linear.from_packed("a8_k", {"weight_packed": weight, "scale_min": sk}, in_features=512,
                                   out_features=32, group_size=32)
    again = Int4Linear(512, 32, 32, bias=False, dtype=torch.float32, layout="a8_k")
    again.load_state_dict(layer.state_dict())
    live = a8.scale_min_rows(sk)[0] != 0  # (a dead group comes back as codes 0 with its super-block's d)
    assert torch.equal(a8.scale_min_rows(again.scale_min)[:, live], a8.scale_min_rows(sk)[:, live])
    x = torch.randn(3, 512)
    assert torch.equal(again(x), layer(x))
    # the weights the kernel multiplies are the two-level scales' exactly
    codes, _, _ = a8.unpack_blocked_int4(weight, sk)
    sm = a8.scale_min_rows(sk).repeat_interleave(32, -1)
    dense = a8.int4_dense_t(again.weight_packed, again.scale_min, 32, torch.float32).t()
    live = sm[0] != 0
    assert torch.equal(dense[live], (codes.float() * sm[0] + sm[1])[live])
    assert torch.equal(dense[~live], sm[1][~live])
    codes, scales, zeros = _int4(32, 512, 32)
    with pytest.raises(ValueError, match="Q4_K's two-level scales .* do not factor that way: use the a8 layout"):
        Int4Linear.from_codes(codes, scales, zeros, group_size=32, layout="a8_k")
    with pytest.raises(ValueError, match="group_size 32 and in_features divisible by 256"):
        Int4Linear(96, 32, 32, bias=False, dtype=torch.float32, layout="a8_k")


def test_symmetric_layout_takes_symmetric_codes_in_fp16_range_only():
    from infopt.quantize.formats.int4_layouts import symmetric

    codes = torch.randint(0, 16, (16, 64), dtype=torch.uint8)
    scales, eights = torch.full((16, 2), 0.01), torch.full((16, 2), 8.0)
    layer = Int4Linear.from_codes(codes, scales, eights, group_size=32, layout="a8_sym")
    assert layer.scale_min.shape == (1, 2, 16) and layer.scale_min.dtype == torch.float16
    torch.testing.assert_close(layer.dequantize(), (codes.float() - 8) * scales.half().float().repeat_interleave(32, 1))
    with pytest.raises(ValueError, match="symmetric int4 codes only .every zero point 8.; .* use the a8 layout"):
        Int4Linear.from_codes(codes, scales, torch.full((16, 2), 7.0), group_size=32, layout="a8_sym")
    assert symmetric(eights, scales) and not symmetric(eights, torch.full((16, 2), 1e-6))  # fp16 subnormal: a8


def test_plain_from_pretrained_rebuilds_a8_layers(tmp_path):
    from transformers import AutoModelForCausalLM

    m = _a8_model()
    m.save_pretrained(tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.model.layers[0].self_attn.k_proj.layout == "a8" and loaded.lm_head.activations == "int8"
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    assert torch.equal(loaded(ids).logits, m(ids).logits)


def test_undo_restores_the_float_model():
    torch.manual_seed(0)
    m = tiny_model()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    ref = m(ids).logits
    infopt.optimize(m, [{"quantize": {"method": "int4", "group_size": 32, "activations": "int8"}}])
    assert not torch.equal(m(ids).logits, ref)
    infopt.undo(m)
    assert torch.equal(m(ids).logits, ref)


# -- the compile pass ------------------------------------------------------------------------------------------------

@kernel
@pytest.mark.slow
def test_compiled_decode_fuses_shared_input_calls_and_keeps_tokens():
    from torch.profiler import profile

    torch.manual_seed(0)
    m = tiny_model()
    eager = _a8_model()
    ids = torch.randint(0, m.config.vocab_size, (1, 10))
    want = eager.generate(ids, max_new_tokens=12, do_sample=False)
    infopt.optimize(m, [{"quantize": {"method": "int4", "group_size": 32, "include_lm_head": True,
                                      "activations": "int8"}},
                        {"kvcache": {"kind": "static"}}, {"compile": {"mode": "default", "warmup_lengths": [64]}}])
    with profile() as prof:
        got = m.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, want)
    calls = {e.key: e.count for e in prof.key_averages()}
    layers, steps = m.config.num_hidden_layers, 11  # the prompt runs eagerly, then 11 compiled one-token steps
    # per decoder layer and step: one q/k/v call and one gate/up call fused, o_proj and down_proj alone
    assert calls.get("infopt::int4_a8_linear_n", 0) == 2 * layers * steps
    assert calls.get("infopt::int4_a8_linear", 0) == 2 * layers * steps + 7 * layers  # + the eager prompt


@kernel
def test_pass_leaves_calls_on_different_inputs_alone():
    from torch import fx

    from infopt.compile.passes import fuse_shared_input_linears

    w1, s1 = a8.pack_blocked_int4(*_int4(32, 64, 32, 1))
    w2, s2 = a8.pack_blocked_int4(*_int4(16, 64, 32, 2))

    class Two(torch.nn.Module):
        def forward(self, x, y, w1, s1, w2, s2):
            a = torch.ops.infopt.int4_a8_linear(x, w1, s1, 32)
            b = torch.ops.infopt.int4_a8_linear(x, w2, s2, 32)
            c = torch.ops.infopt.int4_a8_linear(y, w2, s2, 32)
            return a.sum() + b.sum() + c.sum()

    gm = fx.symbolic_trace(Two())
    assert fuse_shared_input_linears(gm.graph) == 1
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.infopt.int4_a8_linear_n.default) == 1
    assert targets.count(torch.ops.infopt.int4_a8_linear) == 1  # the call on y
    x, y = torch.randn(2, 64), torch.randn(2, 64)
    torch.testing.assert_close(gm(x, y, w1, s1, w2, s2), Two()(x, y, w1, s1, w2, s2), rtol=0, atol=0)


def test_a8_layers_keep_their_kernel_below_32_rows_with_dense_copies(monkeypatch):
    from infopt.quantize.formats import int4
    from infopt.quantize.formats.int4 import A8_DENSE_MIN_ROWS

    monkeypatch.setattr(int4, "_FAST_BF16", [True])  # where bf16 copies are kept
    torch.manual_seed(0)
    layer = Int4Linear.from_float(torch.nn.Linear(64, 32, bias=False), group_size=32, layout="a8")
    layer.enable_dense()
    before = int4.kernel_calls()
    for rows in (1, 8, A8_DENSE_MIN_ROWS - 1):
        x = torch.randn(rows, 64)
        assert torch.equal(layer(x), a8.int4_a8_linear(x, layer.weight_packed, layer.scale_min, 32))
    x = torch.randn(A8_DENSE_MIN_ROWS, 64)
    assert torch.equal(layer(x), torch.nn.functional.linear(x.to(torch.bfloat16), layer.weight_dense).float())
    assert {k: v - before[k] for k, v in int4.kernel_calls().items() if v != before[k]} == {"a8": 3, "dense": 1}


def test_int8_activations_without_the_kernel_run_the_reference_with_the_cpu_kernels_numbers(monkeypatch, device):
    """Where the C++ kernels do not run (CUDA has none for int8 activations; on CPU they are switched off here), an
    ``activations: int8`` model runs the torch reference, counted, with the same numbers as the CPU kernel; and
    ``auto`` picks float activations on CUDA."""
    from tests.devices import count_calls

    assert a8.resolve("auto", "cuda") == "float"
    m = _a8_model()
    n_int4 = sum(isinstance(mod, Int4Linear) for mod in m.modules())
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    ran, before = "int4_a8_linear" if a8.available() else "reference", a8.kernel_calls()
    cpu = m(ids).logits  # the C++ kernel where it builds
    assert a8.kernel_calls()[ran] - before[ran] == n_int4
    monkeypatch.setattr(a8, "available", lambda: False)  # what a device without the kernels sees
    calls = count_calls(monkeypatch, "infopt.quantize.formats.a8", "int4_a8_reference")
    out = m.to(device)(ids.to(device)).logits.cpu()
    assert len(calls) == n_int4 and all(shape[0] == 6 for shape in calls)
    torch.testing.assert_close(out, cpu, rtol=1e-4, atol=1e-4)


# ---- int8 weights x fp32 activations (fp32 sums) ----------------------------------------------------------------

@kernel
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), n=st.integers(1, 70), k=st.sampled_from([1, 7, 16, 17, 40, 64, 576]),
       seed=st.integers(0, 2**16))
def test_int8_f32_kernel_matches_the_fp32_matmul_of_the_dequantized_weight(rows, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s = torch.rand(n, generator=g) / 50
    x = torch.randn(rows, k, generator=g)
    got = torch.ops.infopt.int8_f32_linear(x, w, s)
    want = (x.double() @ (w.double() * s.double()[:, None]).t()).float()
    # fp32 sums in another order than float64's: a few ulps of the row's magnitude
    tol = 1e-6 * (x.abs().double() @ (w.abs().double() * s.double()[:, None]).t()).float() + 1e-6
    assert bool(((got - want).abs() <= 8 * tol).all())


@kernel
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), n=st.integers(1, 70), groups=st.integers(1, 6),
       group=st.sampled_from([3, 8, 16, 32, 48, 64]), seed=st.integers(0, 2**16))
def test_int8_f32_kernel_with_group_scales_matches_the_fp32_matmul_of_the_dequantized_weight(rows, n, groups, group,
                                                                                              seed):
    # groups that are multiples of the vector width run vectorized, the others (3) in plain C++
    g = torch.Generator().manual_seed(seed)
    k = groups * group
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s = torch.rand(n, groups, generator=g) / 50
    x = torch.randn(rows, k, generator=g)
    got = torch.ops.infopt.int8_f32_linear(x, w, s)
    wd = w.double() * s.double().repeat_interleave(group, dim=1)
    want = (x.double() @ wd.t()).float()
    tol = 1e-6 * (x.abs().double() @ wd.abs().t()).float() + 1e-6
    assert bool(((got - want).abs() <= 8 * tol).all())
    # the torch fallback (other devices) computes the same product, to the same few ulps of each output's magnitude
    # (a fixed 1e-5 failed at n=57, 5 groups of 64: 1.4e-5 on an output of 0.34)
    assert bool(((a8.int8_f32_linear(x.double(), w, s).float() - want).abs() <= 8 * tol).all())


@kernel
def test_int8_f32_kernel_refuses_bad_input_with_its_name():
    w, s = torch.zeros(8, 16, dtype=torch.int8), torch.ones(8)
    with pytest.raises(RuntimeError, match="int8_f32_linear: x must be float32"):
        torch.ops.infopt.int8_f32_linear(torch.zeros(2, 16, dtype=torch.bfloat16), w, s)
    with pytest.raises(RuntimeError, match="int8_f32_linear: x has 15 input features"):
        torch.ops.infopt.int8_f32_linear(torch.zeros(2, 15), w, s)
    with pytest.raises(RuntimeError, match="int8_f32_linear: scale must be"):
        torch.ops.infopt.int8_f32_linear(torch.zeros(2, 16), w, torch.ones(7))
    with pytest.raises(RuntimeError, match="int8_f32_linear: scale has 3 groups per row, which does not divide"):
        torch.ops.infopt.int8_f32_linear(torch.zeros(2, 16), w, torch.ones(8, 3))


def _int8_f32_calls(layer, x) -> int:
    """How many times ``layer(x)`` ran the int8 x fp32 kernel (seen by a dispatch mode, so direct op calls count)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.infopt.int8_f32_linear.default:
                Seen.n += 1
            return func(*args, **(kwargs or {}))

    with Seen():
        layer(x)
    return Seen.n


@kernel
def test_int8_layer_with_float32_compute_keeps_fp32_activations_on_the_kernel():
    torch.manual_seed(0)
    lin = torch.nn.Linear(576, 192)
    layer = Int8Linear.from_float(lin, compute_dtype="float32")
    want_w = layer.dequantize()
    for rows in (1, 3, 16, 17, 64):
        x = torch.randn(rows, 576)
        torch.testing.assert_close(layer(x), x @ want_w.t() + lin.bias, atol=2e-5, rtol=1e-5)
    assert _int8_f32_calls(layer, torch.randn(2, 576)) == 1  # decode rows went to the kernel
    assert _int8_f32_calls(layer, torch.randn(64, 576)) == 1  # and so did a prompt's
    bf16 = Int8Linear.from_float(lin, compute_dtype="bfloat16")
    x = torch.randn(1, 576)
    grouped = Int8Linear.from_float(lin, compute_dtype="float32", group_size=32)
    want_g = grouped.dequantize()
    for rows in (1, 3, 17):
        xg = torch.randn(rows, 576)
        torch.testing.assert_close(grouped(xg), xg @ want_g.t() + lin.bias, atol=2e-5, rtol=1e-5)
    assert _int8_f32_calls(grouped, x) == 1  # per-group scales: decode rows on the kernel, not a weight per call
    exact = x.double() @ want_w.double().t() + lin.bias.double()
    assert (layer(x).double() - exact).abs().max() < (bf16(x).double() - exact).abs().max() / 10


def test_every_a8_layout_counts_as_int8_activations():
    """``bound.int8_activations`` spells the a8 layouts' names (an import would close a loop): it must know each."""
    from types import SimpleNamespace

    from infopt.quantize.bound import int8_activations
    from infopt.quantize.formats.int4_layouts import A8_LAYOUTS

    assert all(int8_activations(SimpleNamespace(layout=name)) for name in A8_LAYOUTS)
    assert not int8_activations(SimpleNamespace(layout="plain"))
