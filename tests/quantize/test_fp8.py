import contextlib
import dataclasses
import doctest

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import infopt
from infopt.core.errors import IncompatibleModelError, RecipeError
from infopt.core.introspect import inspect_model
from infopt.core.step import StepConfig
from infopt.eval import logit_metrics
from infopt.models import tiny_model
from infopt.quantize import FP8, FP8Linear, quantize_
from infopt.quantize.formats import fp8 as fp8_mod
from infopt.quantize.formats.fp8 import FP8_MAX, dequantize_fp8, fp8_supported, quantize_fp8
from infopt.recipe import Recipe
from tests.devices import DEVICES

from ..conftest import assert_state_equal, state_snapshot

IDS = torch.randint(3, 40_000, (1, 48), generator=torch.Generator().manual_seed(0))


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.detach().float(), x.detach().float()
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - x).pow(2).mean()))


def fake_capability(monkeypatch, cap):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)


def _cpu_scaled_mm_works() -> bool:
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, ValueError):  # torch's TORCH_CHECK family
        return False
    return True


# -- config --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [("granularity", "channel"), ("granularity", None), ("activations", "static"),
                                          ("include_lm_head", "yes")], ids=lambda v: str(v))
def test_bad_fields_refused(field, value):
    with pytest.raises(RecipeError, match=f"FP8.{field}="):
        FP8(**{field: value})


@pytest.mark.parametrize("config", [FP8(), FP8(granularity="tensor", include_lm_head=True)], ids=["row", "tensor-head"])
def test_to_dict_round_trip(config):
    d = config.to_dict()
    assert d["quantize"]["method"] == "fp8"
    assert StepConfig.from_dict(d) == config
    r = Recipe.parse({"steps": [d]})
    assert r.steps == (config,)
    assert Recipe.from_yaml(r.to_yaml()) == r


def test_recipe_spellings():
    assert Recipe.parse({"steps": [{"quantize": "fp8"}]}).steps == (FP8(),)
    assert Recipe.parse({"quantize": {"method": "fp8", "granularity": "tensor"}}).steps == (FP8(granularity="tensor"),)
    with pytest.raises(RecipeError, match="no field"):
        Recipe.parse({"quantize": {"method": "fp8", "bits": 8}})


def test_tensor_parallel_rule():
    from infopt.recipe import RULES, check_rules

    assert any(r.b == "quantize:fp8" for r in RULES)
    check_rules([FP8()])  # alone it is fine


def test_doctests():
    res = doctest.testmod(fp8_mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.failed == 0 and res.attempted > 0


# -- device support --------------------------------------------------------------------------------------


@pytest.mark.parametrize("cap, ok", [((7, 5), False), ((8, 0), False), ((8, 6), False), ((8, 9), True),
                                     ((9, 0), True), ((10, 0), True)], ids=lambda v: str(v))
def test_fp8_supported_by_capability(monkeypatch, cap, ok):
    fake_capability(monkeypatch, cap)
    monkeypatch.setattr(torch.version, "hip", None)
    got, reason = fp8_supported(torch.device("cuda", 0))
    assert got is ok
    if not ok:
        assert f"compute capability {cap[0]}.{cap[1]}" in reason and "cuda:0" in reason
    else:
        assert reason == ""


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_fp8_supported_refuses_non_cuda(device):
    ok, reason = fp8_supported(device)
    assert not ok and f"no fp8 matmul kernel on {device}" in reason


def test_fp8_supported_refuses_rocm_and_old_torch(monkeypatch):
    fake_capability(monkeypatch, (9, 4))
    monkeypatch.setattr(torch.version, "hip", "6.2")
    ok, reason = fp8_supported("cuda")
    assert not ok and "ROCm" in reason
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch, "__version__", "2.4.1+cu121")
    ok, reason = fp8_supported("cuda")
    assert not ok and "2.4.1" in reason


def test_refused_on_cpu_before_touching_the_model(llama):
    snap = state_snapshot(llama)
    with pytest.raises(IncompatibleModelError) as e:
        infopt.optimize(llama, [FP8()])
    msg = str(e.value)
    assert "no fp8 matmul kernel on cpu" in msg and "Int8WeightOnly" in msg and "Int4WeightOnly" in msg
    assert_state_equal(llama, snap)
    assert type(llama.model.layers[0].mlp.up_proj) is nn.Linear
    assert "infopt" not in llama.__dict__ and "generate" not in llama.__dict__
    with pytest.raises(IncompatibleModelError, match="cpu"):
        quantize_(llama, FP8())
    assert_state_equal(llama, snap)


@pytest.mark.parametrize("cap", [(8, 0), (8, 6)], ids=["a100", "sm86"])
def test_check_refuses_old_gpu_naming_capability(monkeypatch, llama, cap):
    fake_capability(monkeypatch, cap)
    monkeypatch.setattr(torch.version, "hip", None)
    info = dataclasses.replace(inspect_model(llama), device=torch.device("cuda", 0))
    with pytest.raises(IncompatibleModelError, match=rf"compute capability {cap[0]}\.{cap[1]}.*Int8WeightOnly"):
        FP8().check(llama, info, (FP8(),))
    fake_capability(monkeypatch, (9, 0))
    assert FP8().check(llama, info, (FP8(),)) == []


def test_check_refuses_features_not_multiple_of_16(monkeypatch):
    m = tiny_model("llama", hidden_size=72, num_heads=4, num_kv_heads=2)  # 72 % 16 != 0
    fake_capability(monkeypatch, (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    info = dataclasses.replace(inspect_model(m), device=torch.device("cuda", 0))
    with pytest.raises(IncompatibleModelError, match=r"q_proj is 72 -> 72 features; .*multiples of 16"):
        FP8().check(m, info, (FP8(),))


# -- numerics (pure-torch reference, CPU) -------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), cols=st.integers(1, 40), spread=st.floats(1e-4, 1e4), seed=st.integers(0, 2**16),
       granularity=st.sampled_from(["row", "tensor"]))
def test_quantize_fp8_error_bounded(rows, cols, spread, seed, granularity):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * spread
    codes, scale = quantize_fp8(x, granularity)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == ((rows, 1) if granularity == "row" else (1,))
    assert float(codes.float().abs().max()) <= FP8_MAX
    y = dequantize_fp8(codes, scale)
    # e4m3: 3 mantissa bits, so half a step is 2^-4 of the value for normals; subnormals (below 2^-6 of the
    # scale unit) are spaced 2^-9 of it
    bound = torch.maximum(x.abs() * 2**-4, scale * 2**-10) * (1 + 1e-5) + 1e-30
    assert bool(((y - x).abs() <= bound).all())
    # the absmax of each row (or the tensor) lands on 448 exactly and comes back within fp32 rounding
    top = x.abs().amax(dim=-1) if granularity == "row" else x.abs().amax()
    got = y.abs().amax(dim=-1) if granularity == "row" else y.abs().amax()
    assert torch.allclose(got, top, rtol=1e-6)


def test_zero_rows_stay_zero():
    codes, scale = quantize_fp8(torch.zeros(3, 16))
    assert torch.equal(dequantize_fp8(codes, scale), torch.zeros(3, 16))


@pytest.mark.parametrize("granularity", ["row", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_linear_sqnr(granularity, dtype):
    torch.manual_seed(0)
    lin = nn.Linear(256, 128, bias=True).to(dtype)
    q = FP8Linear.from_float(lin, granularity=granularity)
    assert q.weight_fp8.dtype == torch.float8_e4m3fn and q.weight_fp8.shape == (128, 256)
    assert q.weight_scale.shape == ((128,) if granularity == "row" else (1,))
    x = torch.randn(4, 7, 256, dtype=dtype)
    out = q(x)
    assert q.last_kernel == "reference"  # CPU: no fp8 matmul kernel, the pure-torch path
    assert out.shape == (4, 7, 128) and out.dtype == dtype
    assert torch.equal(out, q.reference_forward(x))
    # fp8 weights and activations (3 mantissa bits each): ~29 dB on Gaussian data
    assert sqnr_db(lin(x), out) > 25
    assert sqnr_db(lin.weight.float(), q.dequantize()) > 28


def test_conv1d_weight_is_transposed():
    from transformers.pytorch_utils import Conv1D

    conv = Conv1D(32, 64)  # [in=64, out=32]
    torch.nn.init.normal_(conv.weight)
    q = FP8Linear.from_float(conv, conv1d=True)
    assert q.in_features == 64 and q.out_features == 32
    x = torch.randn(5, 64)
    assert sqnr_db(conv(x), q(x)) > 25


@pytest.mark.skipif(not _cpu_scaled_mm_works(), reason="this torch has no CPU torch._scaled_mm")
@pytest.mark.parametrize("granularity", ["row", "tensor"])
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_scaled_mm_call_matches_reference_on_cpu(monkeypatch, granularity, rows):
    """The kernel call (operand layout, scale shapes, output dtype) checked where torch has a CPU _scaled_mm."""
    calls = []
    real = torch._scaled_mm

    def counting(*args, **kwargs):
        calls.append((args[0].shape, args[1].stride(), kwargs["scale_a"].shape, kwargs["scale_b"].shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    torch.manual_seed(0)
    q = FP8Linear.from_float(nn.Linear(64, 48, bias=True).to(torch.bfloat16), granularity=granularity)
    q.kernel = "scaled_mm"
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    out = q(x)
    assert q.last_kernel == "scaled_mm" and len(calls) == 1
    (a_shape, b_stride, sa, sb), = calls
    assert a_shape == (rows, 64) and b_stride == (1, 64)  # column-major second operand
    assert (sa, sb) == (((rows, 1), (1, 48)) if granularity == "row" else ((), ()))
    assert sqnr_db(q.reference_forward(x), out) > 40


def test_kernel_field_validated():
    q = FP8Linear.from_float(nn.Linear(32, 16))
    q.kernel = "fast"
    with pytest.raises(ValueError, match="FP8Linear.kernel='fast'"):
        q(torch.randn(2, 32))


# -- state dict ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_state_dict_save_reload(tmp_path, granularity):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    q = FP8Linear.from_float(nn.Linear(64, 32, bias=True), granularity=granularity)
    sd = q.state_dict()
    assert set(sd) == {"weight_fp8", "weight_scale", "bias"}
    assert sd["weight_fp8"].dtype == torch.float8_e4m3fn
    save_file(sd, str(tmp_path / "fp8.safetensors"))
    torch.save(sd, tmp_path / "fp8.pt")
    x = torch.randn(3, 64)
    for loaded in (load_file(str(tmp_path / "fp8.safetensors")), torch.load(tmp_path / "fp8.pt")):
        fresh = FP8Linear(64, 32, bias=True, granularity=granularity)
        fresh.load_state_dict(loaded)
        assert torch.equal(fresh.weight_fp8.view(torch.uint8), q.weight_fp8.view(torch.uint8))
        assert torch.equal(fresh(x), q(x))


# -- the step on a model (CPU: the device check faked, layers on the reference path) ---------------------


def _quantize_on_cpu(monkeypatch, model, config):
    with monkeypatch.context() as mp:
        mp.setattr(fp8_mod, "fp8_supported", lambda device: (True, ""))
        infopt.optimize(model, [config])
    return model


@pytest.mark.parametrize("include_lm_head", [False, True], ids=["head-float", "head-fp8"])
def test_step_swaps_layers_keeps_head_and_undo_restores(monkeypatch, include_lm_head):
    m = tiny_model("llama")
    with torch.no_grad():
        ref = m(IDS).logits
    _quantize_on_cpu(monkeypatch, m, FP8(include_lm_head=include_lm_head))
    assert isinstance(m.model.layers[0].self_attn.q_proj, FP8Linear)
    assert isinstance(m.model.layers[1].mlp.down_proj, FP8Linear)
    assert isinstance(m.lm_head, FP8Linear) is include_lm_head
    assert type(m.model.embed_tokens) is nn.Embedding and m.model.embed_tokens.weight.dtype == torch.float32
    step = m.infopt.steps[0]
    assert step.key == "quantize:fp8" and step.stats["modules_quantized"] == 14 + include_lm_head
    with torch.no_grad():
        out = m(IDS).logits
    fig = logit_metrics(out, ref, IDS)
    assert fig["kl"] < 1e-3 and fig["top1"] >= 0.95
    infopt.undo(m)
    with torch.no_grad():
        assert torch.equal(m(IDS).logits, ref)


def test_weight_bytes_quarter_of_fp32(monkeypatch):
    m = tiny_model("llama")
    _quantize_on_cpu(monkeypatch, m, FP8())
    stats = m.infopt.steps[0].stats
    layers = [mod for mod in m.modules() if isinstance(mod, FP8Linear)]
    n = sum(mod.weight_fp8.numel() for mod in layers)
    scales = sum(mod.weight_scale.numel() for mod in layers)
    # 4 -> 1 byte per weight, plus an fp32 scale per output row
    assert stats["weight_bytes_before"] - stats["weight_bytes_after"] == 3 * n - 4 * scales


# -- on each device: torch._scaled_mm on CUDA (sm_89+), the layers' pure-torch reference on CPU ----------------


@contextlib.contextmanager
def _fp8_step_allowed(monkeypatch, device: str):
    """Inside, the FP8 step applies (and a saved FP8 model loads) on ``device``. The step refuses a device without an
    fp8 matmul kernel (CPU), so its device check is faked inside (a no-op where the GPU has the kernel; a CUDA GPU
    older than sm_89 skips the test); the layers pick their kernel themselves when they run, outside:
    ``torch._scaled_mm`` on CUDA sm_89+, the reference on CPU."""
    ok, reason = DEVICES[device].fp8_matmul()
    if not ok:
        pytest.skip(reason)
    with monkeypatch.context() as mp:
        mp.setattr(fp8_mod, "fp8_supported", lambda device: (True, ""))
        yield


def _fp8_optimize(monkeypatch, device: str, model, config):
    with _fp8_step_allowed(monkeypatch, device):
        infopt.optimize(model, [config])
    return model


def _count_scaled_mm(monkeypatch) -> list:
    calls = []
    real = torch._scaled_mm

    def counting(*args, **kwargs):
        calls.append(kwargs.get("out_dtype"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    return calls


@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_devices_kernel_called_and_matches_reference(monkeypatch, granularity, device):
    dev = DEVICES[device]
    m = tiny_model("llama", dtype=torch.bfloat16).to(device)
    _fp8_optimize(monkeypatch, device, m, FP8(granularity=granularity))
    layers = [mod for mod in m.modules() if isinstance(mod, FP8Linear)]
    assert len(layers) == 14 and all(mod.weight_fp8.device.type == device for mod in layers)
    inputs = {}

    def record(mod, args, out):  # returns None, so the output stays the layer's own
        inputs.setdefault(mod, args[0].detach())

    hooks = [mod.register_forward_hook(record) for mod in layers]
    calls = _count_scaled_mm(monkeypatch)
    with torch.no_grad():
        m(IDS.to(device))
    for h in hooks:
        h.remove()
    # one fp8 matmul per quantized layer where the device has it, none skipped; none elsewhere
    assert len(calls) == (len(layers) if dev.fp8_kernel == "scaled_mm" else 0)
    assert all(mod.last_kernel == dev.fp8_kernel for mod in layers)
    with torch.no_grad():
        for mod, x in inputs.items():
            out, ref = mod(x), mod.reference_forward(x)
            assert out.dtype == torch.bfloat16
            # same fp8 operands; only the summation order and the bf16 rounding of the product differ
            assert sqnr_db(ref, out) > 35, mod


@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_quality_against_bf16(monkeypatch, granularity, device):
    m = tiny_model("llama", dtype=torch.bfloat16).to(device)
    ids = IDS.to(device)
    with torch.no_grad():
        ref = m(ids).logits
        ref_tokens = m.generate(ids[:, :8], max_new_tokens=12, do_sample=False)
    _fp8_optimize(monkeypatch, device, m, FP8(granularity=granularity))
    with torch.no_grad():
        out = m(ids).logits
        tokens = m.generate(ids[:, :8], max_new_tokens=12, do_sample=False)
    assert {mod.last_kernel for mod in m.modules() if isinstance(mod, FP8Linear)} == {DEVICES[device].fp8_kernel}
    fig = logit_metrics(out.cpu(), ref.cpu(), IDS)
    assert fig["kl"] < 1e-3 and fig["top1"] >= 0.95, fig
    assert torch.equal(tokens[:, :9], ref_tokens[:, :9])  # the first new token
    assert (tokens == ref_tokens).float().mean() >= 0.9


def test_save_reload_preserves_outputs(monkeypatch, tmp_path, device):
    from infopt.io import load_optimized, save_optimized

    m = tiny_model("qwen2", dtype=torch.bfloat16).to(device)  # qwen2: biases on q/k/v
    _fp8_optimize(monkeypatch, device, m, FP8(include_lm_head=True))
    ids = IDS.to(device)
    with torch.no_grad():
        logits = m(ids).logits
    save_optimized(m, tmp_path / "saved")
    with _fp8_step_allowed(monkeypatch, device):
        m2, _ = load_optimized(tmp_path / "saved", device=device)
    assert isinstance(m2.lm_head, FP8Linear) and m2.lm_head.weight_fp8.dtype == torch.float8_e4m3fn
    with torch.no_grad():
        assert torch.equal(m2(ids).logits, logits)
    assert m2.lm_head.last_kernel == m.lm_head.last_kernel == DEVICES[device].fp8_kernel
