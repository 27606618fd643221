import pytest
import torch
from torch import nn

import infopt
from infopt.core import availability
from infopt.core.errors import MissingBackendError, RecipeError
from infopt.io import load_optimized, save_optimized
from infopt.models import tiny_model
from infopt.quantize import BnbInt8, BnbNF4, quantize_
from infopt.recipe import Recipe

from ..conftest import assert_state_equal, state_snapshot


def kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    lp, lq = ref_logits.float().log_softmax(-1), logits.float().log_softmax(-1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.detach().float(), x.detach().float()
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - x).pow(2).mean()))


@pytest.fixture
def bnb():
    return pytest.importorskip("bitsandbytes")


@pytest.fixture
def ids():
    return torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))


CONFIGS = [BnbInt8(), BnbInt8(threshold=0.0), BnbNF4(), BnbNF4(compute_dtype="float32", double_quant=False)]
CONFIG_IDS = ["int8-t6", "int8-t0", "nf4-bf16-dq", "nf4-fp32"]


# -- configs and rules (no bitsandbytes needed) ------------------------------------------------------

@pytest.mark.parametrize("cfg,field,value", [
    (BnbInt8, "threshold", -1.0), (BnbInt8, "threshold", "six"), (BnbInt8, "threshold", True),
    (BnbNF4, "compute_dtype", "int8"), (BnbNF4, "double_quant", "yes"), (BnbNF4, "blocksize", 100),
    (BnbNF4, "blocksize", 16),
], ids=lambda v: v.__name__ if isinstance(v, type) else str(v))
def test_bad_fields_refused(cfg, field, value):
    with pytest.raises(RecipeError, match=f"{cfg.__name__}.{field}="):
        cfg(**{field: value})


def test_recipe_spelling():
    r = Recipe.parse({"steps": [{"quantize": {"method": "bnb_nf4", "blocksize": 128}}]})
    assert r.steps == (BnbNF4(blocksize=128),)
    assert Recipe.parse({"steps": [{"quantize": "bnb_int8"}]}).steps == (BnbInt8(),)


@pytest.mark.parametrize("step", [BnbInt8(), BnbNF4()], ids=["int8", "nf4"])
def test_compile_with_bnb_is_refused(step):
    from infopt.compile import Compile
    from infopt.kvcache import Static

    with pytest.raises(RecipeError, match="bitsandbytes kernels break the compiled graph"):
        Recipe.parse([Compile(), Static(max_length=64), step])


@pytest.mark.parametrize("step", [BnbInt8(), BnbNF4()], ids=["int8", "nf4"])
def test_missing_backend_refused_before_touching_the_model(step, monkeypatch):
    real = availability.is_available
    monkeypatch.setattr(availability, "is_available", lambda mod: False if mod == "bitsandbytes" else real(mod))
    m = tiny_model()
    snap = state_snapshot(m)
    with pytest.raises(MissingBackendError, match=r"pip install 'infopt\[bnb\]'") as err:
        infopt.optimize(m, [step])
    assert err.value.extra == "bnb" and err.value.package == "bitsandbytes"
    with pytest.raises(MissingBackendError, match=step.kind):
        quantize_(m, step)
    assert_state_equal(m, snap)
    assert all(type(mod).__module__.startswith(("torch", "transformers")) for mod in m.modules())


# -- numerics (bitsandbytes installed) ---------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("step", CONFIGS, ids=CONFIG_IDS)
def test_tiny_model_kl_small(bnb, arch, step, ids):
    m = tiny_model(arch)
    with torch.no_grad():
        ref = m(ids).logits
        infopt.optimize(m, [step])
        out = m(ids).logits
    cls = bnb.nn.Linear8bitLt if isinstance(step, BnbInt8) else bnb.nn.Linear4bit
    first = m.get_submodule("transformer.h.0.attn.c_attn" if arch == "gpt2" else "model.layers.0.self_attn.q_proj")
    assert isinstance(first, cls)
    assert out.dtype == ref.dtype
    assert kl(ref, out) < (1e-4 if isinstance(step, BnbInt8) else 2e-3)


def test_nf4_uses_the_fused_cpu_kernel_where_shapes_allow(bnb, ids):
    from bitsandbytes.functional import has_avx512bf16

    m = tiny_model()
    infopt.optimize(m, [BnbNF4()])
    with torch.no_grad():
        m(ids)
    up = m.model.layers[0].mlp.up_proj
    assert bool(getattr(up.weight.quant_state, "packing_format_for_cpu", False)) == has_avx512bf16()
    assert m.infopt.steps[0].fallbacks == []


def test_nf4_odd_shapes_take_the_generic_path_and_say_so(bnb, ids):
    """The generic path is the NF4 weight dequantized by infopt (bitsandbytes' own CPU dequantize misreads blocks that
    straddle rows on AVX-512 CPUs) times the activations in the compute dtype, bit for bit, and keeps NF4's rounding:
    ~20 dB on the layer's weight, the model's numbers as the fused path does."""
    from infopt.quantize.formats.bnb import nf4_dequantize

    m = tiny_model()  # in_features 64 and 128: blocksize 128 does not divide 64
    weight = m.model.layers[0].self_attn.q_proj.weight.detach().clone()
    with torch.no_grad():
        ref = m(ids).logits
    infopt.optimize(m, [BnbNF4(blocksize=128)])
    (note,) = m.infopt.steps[0].fallbacks
    assert "generic NF4" in note
    q = m.model.layers[0].self_attn.q_proj
    assert q.support_avx512bf16_for_cpu is False
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = m(ids).logits
        y = q(x)
        w = nf4_dequantize(q.weight.data, q.weight.quant_state)  # [out, in]
        assert torch.equal(y, nn.functional.linear(x.to(q.compute_dtype), w.to(q.compute_dtype)).to(y.dtype))
    assert sqnr_db(weight, w.float()) > 19  # NF4's rounding of a Gaussian weight: ~20 dB (bitsandbytes' CPU read: 12)
    assert sqnr_db(x @ weight.T, y) > 17  # and the layer's output, with bf16 activations
    assert kl(ref, out) < 2e-3 and (ref.argmax(-1) == out.argmax(-1)).float().mean() >= 0.9
    assert not getattr(q.weight.quant_state, "packing_format_for_cpu", False)


@pytest.mark.parametrize(("shape", "blocksize", "nested"),
                         [((64, 128), 64, False), ((32, 256), 128, True), ((96, 64), 128, True), ((64, 32), 64, False)])
def test_nf4_dequantize_reads_bitsandbytes_blocks(bnb, shape, blocksize, nested):
    """``nf4_dequantize`` gives bitsandbytes' own dequantized weight where its blocks fit its rows, and NF4's
    round-to-nearest of each block (the codes bitsandbytes chose, times its absmax) where they straddle rows."""
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    from infopt.quantize.formats.bnb import nf4_dequantize

    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    data, state = quantize_4bit(w, blocksize=blocksize, quant_type="nf4", compress_statistics=nested)
    got = nf4_dequantize(data, state)
    assert got.shape == w.shape and got.dtype == w.dtype
    if shape[1] % blocksize == 0:
        assert torch.equal(got, dequantize_4bit(data, state, quant_type="nf4"))
    blocks = w.reshape(-1, blocksize)
    absmax = blocks.abs().amax(1, keepdim=True)
    nearest = (blocks / absmax).unsqueeze(-1).sub(state.code).abs().argmin(-1)
    want = (state.code[nearest] * absmax).reshape(shape)
    tol = 2e-2 if nested else 1e-6  # a double-quantized absmax is 8-bit
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(absmax.max()))
    assert sqnr_db(w, got) > 19


def test_int8_threshold_keeps_outlier_columns(bnb):
    from infopt.quantize.formats.bnb import make_bnb_int8

    torch.manual_seed(0)
    lin = nn.Linear(128, 64)
    x = torch.randn(8, 128)
    x[:, [3, 90]] *= 40  # outlier activation columns, above the 6.0 threshold
    with torch.no_grad():
        ref = lin(x)
        mixed = make_bnb_int8(lin, BnbInt8(threshold=6.0)).eval()
        plain = make_bnb_int8(lin, BnbInt8(threshold=0.0)).eval()
        s_mixed, s_plain = sqnr_db(ref, mixed(x)), sqnr_db(ref, plain(x))
    assert s_mixed > s_plain + 5, (s_mixed, s_plain)


@pytest.mark.parametrize("step", CONFIGS[::2], ids=CONFIG_IDS[::2])
def test_undo_is_bit_identical(bnb, step, ids):
    m = tiny_model("qwen2")
    snap = state_snapshot(m)
    with torch.no_grad():
        ref = m(ids).logits
        infopt.optimize(m, [step])
        m(ids)
    infopt.undo(m)
    assert_state_equal(m, snap)
    with torch.no_grad():
        assert torch.equal(m(ids).logits, ref)


@pytest.mark.parametrize("ran_first", [True, False], ids=["after-forward", "before-forward"])
@pytest.mark.parametrize("step", CONFIGS, ids=CONFIG_IDS)
def test_save_reload_preserves_outputs(bnb, step, ran_first, ids, tmp_path):
    m = tiny_model("llama")
    infopt.optimize(m, [step])
    before = None
    if ran_first:  # NF4 on an AVX512-BF16 CPU: the weight is now repacked for the fused kernel
        with torch.no_grad():
            before = m(ids).logits
    save_optimized(m, tmp_path / "saved")
    with torch.no_grad():
        logits = m(ids).logits
    if before is not None:
        assert torch.equal(logits, before)  # saving did not change the live model
    m2, _ = load_optimized(tmp_path / "saved")
    with torch.no_grad():
        assert torch.equal(m2(ids).logits, logits)


def test_nf4_without_the_cpu_unpacker_still_quantizes_and_names_the_version_to_save(bnb, ids, tmp_path, monkeypatch):
    """bitsandbytes < 0.49 has no _convert_weight_packed_for_cpu_inverse: NF4 layers build and run without it; only
    saving a weight its CPU kernel repacked needs it, and then the error names the version to install."""
    import bitsandbytes.functional as bnb_functional
    from bitsandbytes.functional import has_avx512bf16

    from infopt.quantize.formats.bnb import nf4_linear_class

    with torch.no_grad():  # the unpacker serves saving only: without it the layers compute the very same numbers
        expected = infopt.optimize(tiny_model("llama"), [BnbNF4()])(ids).logits
    monkeypatch.delattr(bnb_functional, "_convert_weight_packed_for_cpu_inverse")
    nf4_linear_class.cache_clear()  # rebuilt without the unpacker
    try:
        m = tiny_model("llama")
        infopt.optimize(m, [BnbNF4()])
        with torch.no_grad():
            logits = m(ids).logits
        assert torch.equal(logits, expected)
        if has_avx512bf16():  # the fused kernel repacked the weights on that call
            with pytest.raises(MissingBackendError, match=r"bitsandbytes>=0\.49"):
                save_optimized(m, tmp_path / "saved")
        else:
            save_optimized(m, tmp_path / "saved")
            m2, _ = load_optimized(tmp_path / "saved")
            with torch.no_grad():
                assert torch.equal(m2(ids).logits, logits)
    finally:
        nf4_linear_class.cache_clear()  # the next caller rebuilds it with the unpacker restored


# -- on each device (the bitsandbytes CUDA kernels under the gpu marker) -------------------------------------

@pytest.mark.parametrize("step,max_kl,min_top1", [(BnbInt8(), 1e-4, 0.9), (BnbInt8(threshold=0.0), 1e-4, 0.9),
                                                  (BnbNF4(), 2e-3, 0.75)], ids=["int8-t6", "int8-t0", "nf4-bf16"])
def test_bf16_layers_swapped_and_close_to_bf16(bnb, step, max_kl, min_top1, ids, device):
    m = tiny_model("llama", dtype=torch.bfloat16).to(device)
    x = ids.to(device)
    with torch.no_grad():
        ref = m(x).logits
        infopt.optimize(m, [step])
        out = m(x).logits
    cls = bnb.nn.Linear8bitLt if isinstance(step, BnbInt8) else bnb.nn.Linear4bit
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        layer = m.get_submodule(name)
        assert isinstance(layer, cls) and layer.weight.device.type == device, name
        assert layer.weight.dtype == (torch.int8 if isinstance(step, BnbInt8) else torch.uint8)
    assert out.device.type == device and out.dtype == torch.bfloat16
    top1 = float((out.argmax(-1) == ref.argmax(-1)).float().mean())
    # CPU figures on the same model: int8 KL 1.4e-6 and top-1 1.0, NF4 KL 1.3e-4 and top-1 0.96 over 48 positions
    assert kl(ref, out) < max_kl and top1 >= min_top1, (kl(ref, out), top1)
