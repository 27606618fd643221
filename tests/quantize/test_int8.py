import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import infopt
from infopt.io import load_optimized, save_optimized
from infopt.models import tiny_model
from infopt.quantize import Int8Linear, Int8WeightOnly, quantize_
from infopt.quantize.formats.int8_layouts import LAYOUTS


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.detach(), x.detach()
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - x).pow(2).mean()))


@pytest.mark.parametrize("compute_dtype", ["auto", "float32", "bfloat16"])
def test_int8_linear_sqnr(compute_dtype):
    torch.manual_seed(0)
    lin = nn.Linear(256, 128, bias=True)
    q = Int8Linear.from_float(lin, compute_dtype=compute_dtype)
    x = torch.randn(4, 7, 256)
    ref = lin(x)
    out = q(x)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    # int8 per-channel weights: ~40 dB; bf16 activations cost a few dB more
    assert sqnr_db(ref, out) > (35 if compute_dtype == "float32" else 28)


def test_dequantize_roundtrip_error_bounded():
    w = torch.randn(64, 32)
    lin = nn.Linear(32, 64, bias=False)
    lin.weight.data = w
    q = Int8Linear.from_float(lin)
    err = (q.dequantize() - w).abs()
    assert (err <= q.weight_scale[:, None] / 2 + 1e-6).all()


def test_gpt2_conv1d_is_handled(prompt):
    m = tiny_model("gpt2")
    ref = m(prompt).logits
    quantize_(m, Int8WeightOnly(compute_dtype="float32"))
    assert isinstance(m.transformer.h[0].attn.c_attn, Int8Linear)
    assert sqnr_db(ref, m(prompt).logits) > 25


def test_include_exclude_and_filter(llama):
    quantize_(llama, Int8WeightOnly(), exclude=["*.self_attn.*"], filter_fn=lambda mod, fqn: ".0." in fqn)
    layer0, layer1 = llama.model.layers
    assert isinstance(layer0.mlp.up_proj, Int8Linear)
    assert not isinstance(layer0.self_attn.q_proj, Int8Linear)
    assert not isinstance(layer1.mlp.up_proj, Int8Linear)


def test_nothing_matched_raises(llama):
    from infopt.core.errors import IncompatibleModelError

    with pytest.raises(IncompatibleModelError, match="found no linear layer"):
        quantize_(llama, Int8WeightOnly(), include=["nothing.*"])


def test_memory_really_freed(llama):
    from infopt.core.introspect import param_bytes

    before = param_bytes(llama)
    lin = sum(llama.get_submodule(f).weight.numel() for f in
              [n for n, mod in llama.named_modules() if isinstance(mod, nn.Linear) and n != "lm_head"])
    infopt.optimize(llama, [Int8WeightOnly()])
    after = param_bytes(llama)
    # fp32 -> int8 saves 3 bytes per weight, minus the fp32 per-channel scales
    assert before - after > 0.95 * 3 * lin


def test_save_reload_preserves_outputs(tmp_path, prompt):
    m = tiny_model("qwen2")
    infopt.optimize(m, [Int8WeightOnly(), infopt.kvcache.Static(max_length=64)])
    logits = m(prompt).logits
    gen = m.generate(prompt, max_new_tokens=6, do_sample=False)
    save_optimized(m, tmp_path / "saved")
    m2, tok = load_optimized(tmp_path / "saved")
    assert tok is None
    assert isinstance(m2.model.layers[0].mlp.up_proj, Int8Linear)
    assert torch.equal(m2(prompt).logits, logits)
    assert torch.equal(m2.generate(prompt, max_new_tokens=6, do_sample=False), gen)


def test_misaligned_weight_is_realigned_before_the_cpu_kernel():
    """A weight viewed at an offset (a memory-mapped checkpoint) gets an aligned copy before _weight_int8pack_mm."""
    torch.manual_seed(0)
    layer = Int8Linear.from_float(nn.Linear(128, 64), compute_dtype="bfloat16")
    if not hasattr(torch, "_weight_int8pack_mm"):
        pytest.skip("this torch has no CPU int8 kernel")
    x = torch.randn(3, 128)
    want = layer(x)
    buf = torch.empty(64 * 128 + 8, dtype=torch.int8)
    view = buf[8:].view(64, 128)
    view.copy_(layer.weight_int8)
    layer.weight_int8 = view
    assert layer.weight_int8.data_ptr() % 64
    assert torch.equal(layer(x), want)
    assert layer.weight_int8.data_ptr() % 64 == 0


@pytest.mark.parametrize("group_size", [None, 32])
def test_float32_without_the_kernels_dequantizes_in_chunks_of_rows(monkeypatch, group_size):
    """Without infopt's C++ kernels, fp32 calls run on the weight dequantized a chunk of rows at a time into a reused
    buffer: the same product as the whole dequantized weight, across chunk edges (chunks of 3 rows of 64 here, 40
    rows: a partial last chunk)."""
    import infopt.quantize.formats.int8_layouts as layouts

    monkeypatch.setattr(layouts.a8, "available", lambda: False)
    monkeypatch.setattr(layouts, "_CHUNK_WEIGHTS", 3 * 64)
    monkeypatch.setattr(layouts, "_SCRATCH", threading.local())
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 40)
    layer = Int8Linear.from_float(lin, compute_dtype="float32", group_size=group_size)
    x = torch.randn(2, 20, 64)
    want = x @ layer.dequantize().t() + lin.bias
    got = layer(x)
    assert got.shape == (2, 20, 40) and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert layouts._SCRATCH.buf.numel() == 3 * 64  # one buffer of one chunk, reused for every chunk


def test_auto_compute_dtype_is_fp32_for_fp32_models_where_the_kernel_was_measured_faster():
    """``compute_dtype="auto"``: fp32 models on CPUs whose C++ kernels build with AVX-512 get fp32 activations on the
    int8 x fp32 kernel (measured faster than bf16 on torch's kernel there); other CPUs keep bf16 activations, and a
    bf16 model keeps its own dtype's kernel."""
    from infopt.quantize.formats import a8

    fp32 = Int8Linear.from_float(nn.Linear(64, 32))
    bf16 = Int8Linear.from_float(nn.Linear(64, 32).to(torch.bfloat16))
    if a8.isa() == "avx512_vnni":
        assert fp32.compute_dtype == torch.float32
    elif hasattr(torch, "_weight_int8pack_mm"):
        assert fp32.compute_dtype == torch.bfloat16
    assert bf16.compute_dtype == (torch.bfloat16 if hasattr(torch, "_weight_int8pack_mm") else None)
    x = torch.randn(3, 64)
    torch.testing.assert_close(fp32(x), x @ fp32.dequantize().t() + fp32.bias, atol=3e-2, rtol=1e-2)


@settings(max_examples=30, deadline=None)
@given(layout=st.sampled_from(sorted(LAYOUTS)), blocks=st.integers(1, 4), k=st.sampled_from([4, 12, 40, 64, 96]),
       seed=st.integers(0, 2**16))
def test_each_layout_keeps_the_codes_exactly(layout, blocks, k, seed):
    """Codes set into a layout come back exactly, whole (``codes()``, the saved ``weight_int8``) and row by row."""
    n = 16 * blocks
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(seed))
    activations = LAYOUTS[layout].activations
    layer = Int8Linear.from_codes(codes, torch.rand(n) + 0.1, activations=activations)
    assert layer.layout == layout and layer.activations == activations
    assert torch.equal(layer.codes(), codes)
    assert torch.equal(layer.state_dict()["weight_int8"], codes)
    index = torch.tensor([[n - 1, 0], [n // 2, 3]])
    assert torch.equal(layer.rows(index), codes[index].float() * layer.weight_scale[index, None])
    fresh = Int8Linear(k, n, bias=False, dtype=torch.float32, compute_dtype=None, activations=activations)
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh.codes(), codes)


def test_unknown_or_unfitting_layout_is_refused():
    with pytest.raises(ValueError, match="activations must be 'float' or 'int8', got 'int4'"):
        Int8Linear(64, 32, bias=False, dtype=torch.float32, compute_dtype=None, activations="int4")
    with pytest.raises(ValueError, match="out_features divisible by 16.*64 -> 24"):
        Int8Linear(64, 24, bias=False, dtype=torch.float32, compute_dtype=None, activations="int8")
    with pytest.raises(ValueError, match="multiple of the activation group, 16 for 64 input channels; got 8"):
        Int8Linear.from_float(nn.Linear(64, 32), group_size=8, activations="int8")
    assert LAYOUTS["a8"].fits(32, 64, 32) is None and LAYOUTS["a8"].fits(32, 36, 12) is None  # 4 | 12
    assert LAYOUTS["plain"].fits(24, 64, 32) is None


@pytest.mark.parametrize("activations", ["float", "int8"])
def test_from_codes_fills_every_buffer_it_leaves_uninitialised(activations):
    """``from_codes`` allocates the layout's buffers uninitialised (the codes overwrite them): the layer holds exactly
    the codes, and a layer constructed outside it still starts from zeros."""
    from infopt.quantize.formats.int8_layouts import _FILLED_NEXT, filled_next

    torch.manual_seed(0)
    codes = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    scales = torch.rand(32) + 0.1
    layer = Int8Linear.from_codes(codes, scales, activations=activations)
    assert torch.equal(layer.codes(), codes) and torch.equal(layer.weight_scale, scales)
    assert _FILLED_NEXT.get() is False
    with pytest.raises(RuntimeError), filled_next():
        assert _FILLED_NEXT.get() is True
        raise RuntimeError
    assert _FILLED_NEXT.get() is False  # reset on the way out, an error included
    fresh = Int8Linear(64, 32, bias=False, dtype=torch.float32, compute_dtype=torch.float32, activations=activations)
    assert all(int(b.count_nonzero()) == 0 for name, b in fresh.named_buffers() if name != "weight_scale")
