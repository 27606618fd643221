"""Calibrated quantizers on each device (``cpu``, and ``cuda`` under the gpu marker): GPTQ and AWQ layers run the
device's int4 kernel (tinygemm on CUDA, torch's int4 CPU kernel), SmoothQuant's W8A8 layers ``torch._int_mm`` where
it serves, each counted, with logits close to the unquantized model's. On CUDA also both ways onto the GPU:
calibrated there, or calibrated on CPU and moved with ``.cuda()``."""

import pytest
import torch
from torch import nn

import infopt
from infopt.io import load_optimized, save_optimized
from infopt.models import tiny_model
from infopt.quantize import AWQ, GPTQ, Int4Linear, SmoothQuantW8A8, W8A8Linear, quantize_
from tests.devices import DEVICES, count_calls

VOCAB = 49152


def calib(n=8, seq=64, seed=0):
    return torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed))


def eval_ids(device="cpu"):
    return torch.randint(3, 40_000, (2, 48), generator=torch.Generator().manual_seed(7)).to(device)


def kl_top1(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """Mean KL(ref || new) in nats per position, and top-1 agreement."""
    lp, lq = ref_logits.float().log_softmax(-1), logits.float().log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return float(kl.mean()), float((ref_logits.argmax(-1) == logits.argmax(-1)).float().mean())


def config_for(method: str, act_order: bool = True):
    if method == "gptq":
        return GPTQ(group_size=32, samples=8, seq_len=64, act_order=act_order)
    return AWQ(group_size=32, samples=8, seq_len=64)


def int4_layers(model) -> list[Int4Linear]:
    return [mod for mod in model.modules() if isinstance(mod, Int4Linear)]


# the bounds: measured on CPU (the int4 CPU kernel also takes bf16 activations) KL ~1e-4 and top-1 >= 0.99 on
# these tiny llamas; a wrong packing or kernel gives KL ~1e-2 and top-1 near chance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_int4_calibrated_on_the_device_runs_its_int4_kernel(method, dtype, monkeypatch, device):
    dev = DEVICES[device]
    m = tiny_model("llama", dtype=dtype).to(device)
    ids = eval_ids(device)
    with torch.no_grad():
        base = m(ids).logits
    quantize_(m, config_for(method), calibration=calib().to(device))
    layers = int4_layers(m)
    assert len(layers) == 14 and {mod.layout for mod in layers} == {dev.int4_layout}
    assert all(mod.scale_offset.device.type == device and mod.weight_packed.device.type == device for mod in layers)
    if method == "gptq":  # act_order: each layer gathers its inputs through a permutation on the device
        assert all(mod.in_perm is not None and mod.in_perm.device.type == device for mod in layers)
    calls = count_calls(monkeypatch, "torch", dev.int4_op)
    with torch.no_grad():
        out = m(ids).logits
    assert len(calls) == len(layers)  # one kernel call per quantized layer, nothing dequantized on the side
    assert out.dtype == dtype
    kl, top1 = kl_top1(base, out)
    assert kl < 1e-3 and top1 >= 0.95, (kl, top1)
    infopt.undo(m)  # the float layers come back, on the device
    assert not int4_layers(m) and m.model.layers[0].mlp.up_proj.weight.device.type == device
    with torch.no_grad():
        assert torch.equal(m(ids).logits, base)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_int4_calibrated_on_cpu_then_moved_repacks_for_cuda(method, monkeypatch):
    m = tiny_model("llama")
    quantize_(m, config_for(method), calibration=calib())
    assert {mod.layout for mod in int4_layers(m)} == {"cpu_int4pack"}
    ids = eval_ids("cuda")
    with torch.no_grad():
        cpu_logits = m(ids.cpu()).logits
    cpu_state = {k: v.clone() for k, v in m.state_dict().items()}
    m.cuda()
    layers = int4_layers(m)
    assert len(layers) == 14 and {mod.layout for mod in layers} == {"cuda_tinygemm"}
    gpu_state = m.state_dict()
    for k, v in cpu_state.items():  # the same codes, read back out of the CUDA packing
        if k.endswith(("qweight", "in_perm")):
            assert torch.equal(gpu_state[k].cpu(), v), k
        elif k.endswith(("scales", "zeros")):
            torch.testing.assert_close(gpu_state[k].cpu(), v, rtol=1e-6, atol=1e-6, msg=k)
    calls = count_calls(monkeypatch, "torch", "_weight_int4pack_mm")
    with torch.no_grad():
        out = m(ids).logits
    assert len(calls) == len(layers)
    kl, top1 = kl_top1(cpu_logits.cuda(), out)  # the same int4 model on the other device's kernel
    assert kl < 1e-4 and top1 >= 0.97, (kl, top1)


def test_gptq_save_reload_on_the_device_and_on_cpu(tmp_path, device):
    m = tiny_model("llama").to(device)
    infopt.optimize(m, [config_for("gptq")], calibration=calib())
    ids = eval_ids(device)
    with torch.no_grad():
        logits = m(ids).logits
    save_optimized(m, tmp_path / "saved")
    on_device, _ = load_optimized(tmp_path / "saved", device=device)
    assert {mod.layout for mod in int4_layers(on_device)} == {DEVICES[device].int4_layout}
    on_cpu, _ = load_optimized(tmp_path / "saved", device="cpu")
    with torch.no_grad():
        assert torch.equal(on_device(ids).logits, logits)  # the same codes through the same kernel
        kl, top1 = kl_top1(logits, on_cpu(ids.cpu()).logits.to(device))
    assert kl < 1e-4 and top1 >= 0.97, (kl, top1)


# -- SmoothQuant W8A8 -----------------------------------------------------------------------------


def w8a8_layers(model) -> list[W8A8Linear]:
    return [mod for mod in model.modules() if isinstance(mod, W8A8Linear)]


def _check_w8a8(m, ref, device, monkeypatch):
    """The W8A8 layers of ``m`` (on ``device``) run the device's kernel, each counted, close to ``ref``."""
    dev = DEVICES[device]
    layers = w8a8_layers(m)
    assert len(layers) == m.infopt.steps[0].stats["modules_quantized"] > 0
    assert all(mod.weight_int8.device.type == device and mod.weight_int8.dtype == torch.int8 for mod in layers)
    assert not any(type(mod) is nn.Linear for n, mod in m.named_modules() if n.endswith(("_proj", "c_fc")))
    calls = count_calls(monkeypatch, "torch", "_int_mm")
    ids = eval_ids(device)
    with torch.no_grad():
        out = m(ids).logits
        base = ref(ids).logits
    assert len(calls) == len(layers) * dev.w8a8_int_mm_calls() and all(shape[0] > 16 for shape in calls)  # 96 tokens
    assert {mod.last_kernel for mod in layers} == {dev.w8a8_kernel()}
    kl, top1 = kl_top1(base, out)
    assert kl < 1e-4 and top1 >= 0.95, (kl, top1)  # measured on CPU: KL ~1e-6, top-1 >= 0.99


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_smoothquant_w8a8_calibrated_on_the_device_runs_its_kernel(arch, monkeypatch, device):
    ref = tiny_model(arch).to(device)
    m = tiny_model(arch).to(device)
    infopt.optimize(m, [SmoothQuantW8A8(samples=4, seq_len=32)], calibration=calib(8, 64).to(device))
    # every layer's shape takes torch._int_mm where the device has it (cuBLAS int8); else the reason is reported
    assert (m.infopt.steps[0].fallbacks == []) == (DEVICES[device].w8a8_kernel() == "int_mm")
    _check_w8a8(m, ref, device, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_smoothquant_w8a8_calibrated_on_cpu_then_moved_to_cuda(arch, monkeypatch):
    ref = tiny_model(arch).cuda()
    m = tiny_model(arch)
    infopt.optimize(m, [SmoothQuantW8A8(samples=4, seq_len=32)], calibration=calib(8, 64))
    m.cuda()
    _check_w8a8(m, ref, "cuda", monkeypatch)


def test_w8a8_int_mm_equals_the_float_path(monkeypatch, device):
    """int8 x int8 products summed over <= 128 inputs stay below 2^24, so torch._int_mm's int32 sums and the float
    fallback's fp32 sums are the same integers: the two paths must agree bit for bit, decode steps (one row; padded
    to 17 for cuBLAS on CUDA) included."""
    dev = DEVICES[device]
    if dev.w8a8_kernel() != "int_mm":
        pytest.skip("torch._int_mm on this CPU is a scalar loop (no AVX-512) or torch < 2.6: W8A8 runs the float path")
    m = tiny_model("llama").to(device)
    infopt.optimize(m, [SmoothQuantW8A8(samples=4, seq_len=32)], calibration=calib(8, 64))
    layers = w8a8_layers(m)
    ids = eval_ids(device)
    prompt = ids[:1, :12]

    def run(kernel):
        for mod in layers:
            mod.kernel = kernel
        with torch.no_grad():
            return m(ids).logits, m.generate(prompt, max_new_tokens=8, do_sample=False)

    float_logits, float_tokens = run("float")
    assert {mod.last_kernel for mod in layers} == {"float"}
    calls = count_calls(monkeypatch, "torch", "_int_mm")
    int_logits, int_tokens = run("int_mm")
    assert {mod.last_kernel for mod in layers} == {"int_mm"}
    # the 7 decode forwards' one-row calls (padded to 17 rows on CUDA, as the 12-row prompt is), where they reach
    # torch._int_mm from Python; and every forward's: the logits, the prompt, the decode steps
    n = dev.w8a8_int_mm_calls()
    assert sum(shape[0] == dev.w8a8_decode_rows for shape in calls) >= len(layers) * 7 * n, calls[:4]
    assert len(calls) >= len(layers) * 8 * n
    assert torch.equal(int_logits, float_logits)
    assert torch.equal(int_tokens, float_tokens)
