import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import infopt
from infopt.core.errors import IncompatibleModelError, RecipeError
from infopt.io import load_optimized, save_optimized
from infopt.models import tiny_model
from infopt.quantize import Int4Linear, Int4WeightOnly, Int8Linear, Int8WeightOnly, quantize_
from infopt.quantize.formats.int4 import kernel_calls as int4_kernel_calls
from infopt.quantize.formats.int4 import pack_int4, quantize_int4_grouped, unpack_int4
from infopt.recipe import Recipe

from ..conftest import assert_state_equal, state_snapshot


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.detach().float(), x.detach().float()
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - x).pow(2).mean()))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 8), cols=st.integers(1, 16).map(lambda c: 2 * c), seed=st.integers(0, 2**16))
def test_pack_unpack_roundtrip(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (rows, cols // 2) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), codes)


@settings(max_examples=25, deadline=None)
@given(out_blocks=st.integers(1, 4), groups=st.integers(1, 4), group=st.sampled_from([32, 64, 128]),
       symmetric=st.booleans(), zero_point=st.sampled_from(["int", "float"]), seed=st.integers(0, 2**16))
def test_rtn_error_within_half_step(out_blocks, groups, group, symmetric, zero_point, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16 * out_blocks, groups * group, generator=g) * 0.05
    codes, scales, zeros = quantize_int4_grouped(w, group, symmetric, zero_point)
    assert codes.max() <= 15
    if zero_point == "int" or symmetric:
        assert torch.equal(zeros, zeros.round()) and zeros.min() >= 0 and zeros.max() <= 15
    deq = (codes.float() - zeros.float().repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)
    # every weight within half a quantization step (symmetric clips the top code: one step there)
    bound = scales.repeat_interleave(group, 1) * (1.0 if symmetric else 0.5) + 1e-6
    assert ((deq - w).abs() <= bound).all()


@pytest.mark.parametrize("group", [32, 64, 128], ids=lambda g: f"int4-g{g}")
@pytest.mark.parametrize("layout", ["kernel", "plain"])
def test_int4_linear_sqnr_and_paths_agree(group, layout):
    torch.manual_seed(0)
    lin = nn.Linear(256, 128, bias=True)
    q = Int4Linear.from_float(lin, group_size=group)
    if layout == "plain":
        ref_q = q
        q = Int4Linear(256, 128, group, bias=True, dtype=torch.float32, layout="plain")
        q.load_state_dict(ref_q.state_dict())
    x = torch.randn(2, 5, 256)
    before = int4_kernel_calls()[q.layout]
    out = q(x)
    assert int4_kernel_calls()[q.layout] == before + 1  # the layout's own kernel served the call
    assert out.shape == (2, 5, 128) and out.dtype == torch.float32
    # 4-bit grouped weights on Gaussian weights: ~20-25 dB; a floor well clear of noise
    assert sqnr_db(lin(x), out) > 17
    # the reference (dequantize + fp32 matmul) and the fused kernel agree up to bf16 activations
    ref = x @ q.dequantize().t() + lin.bias
    assert sqnr_db(ref, out) > 30


def test_kernel_layout_is_used_on_cpu_and_state_dict_is_portable():
    lin = nn.Linear(128, 64, bias=False)
    q = Int4Linear.from_float(lin, group_size=32)
    assert q.layout == "cpu_int4pack"
    sd = q.state_dict()
    assert set(sd) == {"qweight", "scales", "zeros"}
    assert sd["qweight"].shape == (64, 64) and sd["qweight"].dtype == torch.uint8
    codes, scales, zeros = quantize_int4_grouped(lin.weight, 32, zero_point="float")
    # the kernel layout round-trips to the same codes (scales and offsets pass through bf16)
    assert torch.equal(unpack_int4(sd["qweight"]), codes)
    assert torch.allclose(sd["scales"], scales, rtol=1e-2)
    assert torch.allclose(sd["zeros"], zeros, atol=0.1)


def test_weight_bytes_about_an_eighth(llama):
    from infopt.core.introspect import param_bytes

    lin = {n: m for n, m in llama.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}
    fp32 = sum(m.weight.numel() * 4 for m in lin.values())
    quantize_(llama, Int4WeightOnly(group_size=32))
    q = sum(param_bytes(llama.get_submodule(n)) for n in lin)
    # codes 0.5 B + bf16 (scale, offset) per 32 weights: 0.625 B per weight = 0.156x of fp32
    assert q <= 0.16 * fp32


def test_float_zero_point_recovers_weights_already_on_a_4bit_grid():
    # weights dequantized from a min/scale 4-bit format (like the embedded model's Q4_1 GGUF) are
    # 16 affine levels per group; the float zero point lands on them, an integer one cannot
    torch.manual_seed(0)
    lo = torch.randn(64, 8, 1) * 0.1 - 0.05
    step = torch.rand(64, 8, 1) * 0.01 + 0.001
    codes = torch.randint(0, 16, (64, 8, 32))
    codes[..., 0], codes[..., 1] = 0, 15  # every group spans its full range
    w = (lo + codes * step).reshape(64, 256)
    c, s, z = quantize_int4_grouped(w, 32, zero_point="float")
    deq = (c.float() - z.repeat_interleave(32, 1)) * s.repeat_interleave(32, 1)
    assert (deq - w).abs().max() < 1e-5
    c, s, z = quantize_int4_grouped(w, 32, zero_point="int")
    deq_int = (c.float() - z.repeat_interleave(32, 1)) * s.repeat_interleave(32, 1)
    assert (deq_int - w).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma"])
def test_model_quality_and_undo(arch, prompt):
    m = tiny_model(arch)
    ref = m(prompt).logits
    snap = state_snapshot(m)
    infopt.optimize(m, [Int4WeightOnly(group_size=32)])
    assert isinstance(m.model.layers[0].mlp.down_proj, Int4Linear)
    out = m(prompt).logits
    kl = torch.nn.functional.kl_div(out.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean")
    assert float(kl.detach()) / prompt.shape[1] < 0.05
    infopt.undo(m)
    assert_state_equal(m, snap)
    assert torch.equal(m(prompt).logits, ref)


def test_group_size_not_dividing_is_refused_before_mutation(llama):
    snap = state_snapshot(llama)
    # the tiny llama has 64 hidden channels: 128 does not divide them
    with pytest.raises(IncompatibleModelError, match=r"in_features=64; use group_size 64 or 32"):
        infopt.optimize(llama, [Int4WeightOnly(group_size=128)])
    assert_state_equal(llama, snap)


@pytest.mark.parametrize("bad", [{"group_size": 48}, {"group_size": 0}, {"group_size": 32.0}, {"symmetric": "yes"}, {"zero_point": "half"}])
def test_bad_fields(bad):
    with pytest.raises(RecipeError, match=next(iter(bad))):
        Int4WeightOnly(**bad)


def test_bits_3_is_not_a_method():
    with pytest.raises(RecipeError, match="unknown quantize method 'int3'"):
        Recipe.parse([{"quantize": {"method": "int3"}}])


def test_recipe_spelling():
    r = Recipe.parse([{"quantize": {"method": "int4", "group_size": 64}}])
    assert r.steps == (Int4WeightOnly(group_size=64),)
    assert Recipe.from_yaml(r.to_yaml()) == r


@pytest.mark.parametrize("config,head", [
    (Int4WeightOnly(group_size=32, include_lm_head=True), Int8Linear),
    (Int4WeightOnly(group_size=32, include_lm_head=True, lm_head_bits=4), Int4Linear),
    (Int8WeightOnly(include_lm_head=True), Int8Linear)], ids=["int4-head8", "int4-head4", "int8"])
def test_tied_lm_head_gets_its_own_quantized_copy(config, head, prompt):
    m = tiny_model("llama")
    assert m.lm_head.weight is m.model.embed_tokens.weight
    emb = m.model.embed_tokens.weight.detach().clone()
    ref = m(prompt).logits
    infopt.optimize(m, [config])
    assert type(m.lm_head) is head
    assert torch.equal(m.model.embed_tokens.weight, emb)  # lookups keep the float table
    assert sqnr_db(ref, m(prompt).logits) > 10
    infopt.undo(m)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert torch.equal(m(prompt).logits, ref)


def test_save_reload_identical(tmp_path, prompt):
    m = tiny_model("llama")
    infopt.optimize(m, [Int4WeightOnly(group_size=32, include_lm_head=True)])
    logits = m(prompt).logits
    save_optimized(m, tmp_path / "q4")
    m2, _ = load_optimized(tmp_path / "q4")
    assert isinstance(m2.model.layers[1].self_attn.o_proj, Int4Linear)
    assert torch.equal(m2(prompt).logits, logits)


def test_int8_groups(prompt):
    torch.manual_seed(0)
    lin = nn.Linear(128, 64)
    per_channel = Int8Linear.from_float(lin, compute_dtype="float32")
    grouped = Int8Linear.from_float(lin, compute_dtype="float32", group_size=32)
    assert grouped.weight_scale.shape == (64, 4)
    x = torch.randn(3, 128)
    assert sqnr_db(lin(x), grouped(x)) >= sqnr_db(lin(x), per_channel(x))
    m = tiny_model()
    with pytest.raises(IncompatibleModelError, match="group_size=48"):
        infopt.optimize(m, [Int8WeightOnly(group_size=48)])
    infopt.optimize(m, [Int8WeightOnly(group_size=32)])
    assert m.model.layers[0].mlp.up_proj.group_size == 32


def test_save_pretrained_then_infopt_load(tmp_path, prompt):
    m = tiny_model("qwen2")
    infopt.optimize(m, [Int4WeightOnly(group_size=32, include_lm_head=True)])
    logits = m(prompt).logits
    m.save_pretrained(tmp_path / "hf")  # the optimized model's save_pretrained also writes the recipe
    assert (tmp_path / "hf" / "infopt_recipe.yaml").is_file()
    m2, _ = infopt.load(tmp_path / "hf")
    assert isinstance(m2.lm_head, Int8Linear)
    assert torch.equal(m2(prompt).logits, logits)
    infopt.undo(m)
    m.save_pretrained(tmp_path / "plain")
    assert not (tmp_path / "plain" / "infopt_recipe.yaml").exists()


@pytest.mark.parametrize("in_features, tiles", [(4096, 8), (1536, 8), (576, 4), (192, 4), (96, 2), (64, 4),
                                                (48, None), (40, None)])
def test_cuda_packing_tiles_fit_in_features(in_features, tiles):
    """torch's CUDA packer takes innerKTiles 2/4/8 and needs in_features % (16 * innerKTiles) == 0: the default
    model's 576 cannot take 8 (the old fixed choice), and a layer fitting none stays portable on CUDA."""
    from infopt.quantize.formats.int4 import cuda_inner_k_tiles, layout_for

    assert cuda_inner_k_tiles(in_features) == tiles
    if tiles is not None:
        assert in_features % (16 * tiles) == 0
    want = "cuda_tinygemm" if tiles else "plain"
    assert layout_for(torch.device("cuda"), in_features, 64, 32 if in_features % 32 == 0 else 16) in (want, "plain")
    assert layout_for(torch.device("cuda"), in_features, 64, 32) == (want if in_features % 32 == 0 else "plain")
    assert layout_for(torch.device("cuda"), 4096, 40, 32) == "plain"  # out_features not a multiple of 16


def test_to_another_device_repacks_for_its_kernel(monkeypatch):
    """An automatic layout follows the device: moving a layer leaves the old device's packing through the
    portable layout and repacks for the new one (on CPU, a stand-in device whose kernel is 'plain')."""
    import infopt.quantize.formats.int4 as int4

    torch.manual_seed(0)
    lin = nn.Linear(128, 64, bias=True)
    layer = Int4Linear.from_float(lin, group_size=32)
    assert layer.layout == "cpu_int4pack"
    x = torch.randn(3, 128)
    y0, w0 = layer(x), layer.dequantize()
    sd0 = {k: v.clone() for k, v in layer.state_dict().items()}

    monkeypatch.setattr(int4, "layout_for", lambda *a: "plain")
    layer.to("cpu")
    assert layer.layout == "plain" and layer.qweight.shape == (64, 64) and not hasattr(layer, "weight_packed")
    assert torch.equal(layer.dequantize(), w0)
    assert all(torch.equal(v, sd0[k]) for k, v in layer.state_dict().items())
    monkeypatch.undo()
    layer.to("cpu")
    assert layer.layout == "cpu_int4pack" and not hasattr(layer, "qweight")
    assert torch.equal(layer.dequantize(), w0) and torch.equal(layer(x), y0)

    forced = Int4Linear(128, 64, 32, bias=True, dtype=torch.float32, layout="plain")
    forced.load_state_dict(sd0)
    forced.to("cpu")
    assert forced.layout == "plain"  # a layout asked for is kept


def _int4_kernel_matches(m, device, monkeypatch):
    """``m``'s int4 layers (a 576-wide bf16 llama on ``device``) take the device's kernel, counted, and compute what a
    dense bf16 model carrying the very weights the codes decode to computes.

    A random model's logits are nearly flat (top-1 flips on tiny differences), so the kernel is held to that dense
    model, and only loosely to the original model."""
    from infopt.eval.metrics import logit_metrics
    from tests.devices import DEVICES, count_calls

    dev = DEVICES[device]
    cfg_kw = dict(hidden_size=576, num_heads=9, num_kv_heads=3)
    ref = tiny_model("llama", dtype=torch.bfloat16, **cfg_kw).to(device)
    deq = tiny_model("llama", dtype=torch.bfloat16, **cfg_kw).to(device)
    layers = {name: mod for name, mod in m.named_modules() if isinstance(mod, Int4Linear)}
    assert layers and all(mod.layout == dev.int4_layout for mod in layers.values())
    with torch.no_grad():
        for name, mod in layers.items():
            deq.get_submodule(name).weight.copy_(mod.dequantize())
    calls = count_calls(monkeypatch, "torch", dev.int4_op)
    ids = torch.randint(3, 1000, (1, 24), device=device)
    before = int4_kernel_calls()[dev.int4_layout]
    with torch.no_grad():
        out = m(ids).logits.float()
        want = deq(ids).logits.float()
        base = ref(ids).logits.float()
    assert len(calls) >= len(layers)
    assert int4_kernel_calls()[dev.int4_layout] - before == len(layers)  # every layer's forward, on the kernel
    exact = logit_metrics(out, want, ids)
    assert exact["kl"] < 1e-3 and exact["top1"] >= 0.9, exact  # the same weights: rounding differences only
    assert logit_metrics(out, base, ids)["kl"] < 0.05


def test_int4_kernel_runs_and_matches(monkeypatch, device):
    """Int4 quantized on the device runs its kernel (tinygemm on CUDA, torch's int4 CPU kernel), counted, on the
    default model's 576-wide layers too; outputs match the dequantized reference."""
    m = tiny_model("llama", dtype=torch.bfloat16, hidden_size=576, num_heads=9, num_kv_heads=3).to(device)
    quantize_(m, Int4WeightOnly(group_size=32))
    _int4_kernel_matches(m, device, monkeypatch)


@pytest.mark.gpu
def test_int4_quantized_on_cpu_then_moved_runs_the_cuda_kernel(monkeypatch):
    """A model quantized on CPU and moved with .cuda() is repacked for tinygemm and matches as one quantized there."""
    m = tiny_model("llama", dtype=torch.bfloat16, hidden_size=576, num_heads=9, num_kv_heads=3)
    quantize_(m, Int4WeightOnly(group_size=32))
    _int4_kernel_matches(m.cuda(), "cuda", monkeypatch)