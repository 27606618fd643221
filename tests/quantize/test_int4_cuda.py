"""Int4WeightOnly on CUDA: prompts through the bf16 copies and decode steps through torch's int4 kernel
(``dense_prefill``), each counted; and the CUDA packing read back to the same portable codes as the CPU's."""

import pytest
import torch

import infopt
from infopt.models import tiny_model
from infopt.quantize import Int4Linear, Int4WeightOnly, quantize_
from infopt.quantize.int4 import DENSE_MIN_ROWS

from .test_calibrated_cuda import counting, kl_top1

pytestmark = pytest.mark.gpu


def int4_layers(model) -> list[Int4Linear]:
    return [mod for mod in model.modules() if isinstance(mod, Int4Linear)]


def test_dense_prefill_prompts_in_bf16_decode_steps_in_the_kernel(monkeypatch):
    m = tiny_model("llama", dtype=torch.bfloat16).cuda()
    ids = torch.randint(3, 40_000, (1, 24), generator=torch.Generator().manual_seed(7)).cuda()
    with torch.no_grad():
        base = m(ids).logits
    infopt.optimize(m, [Int4WeightOnly(group_size=32, dense_prefill=True)])
    layers = int4_layers(m)
    assert len(layers) == 14 and {mod.layout for mod in layers} == {"cuda_tinygemm"}
    assert all(mod.weight_dense.is_cuda and mod.weight_dense.dtype == torch.bfloat16 for mod in layers)
    calls = counting(monkeypatch, "_weight_int4pack_mm")
    with torch.no_grad():
        out = m(ids).logits  # 24 rows >= DENSE_MIN_ROWS: the bf16 copies
    assert ids.shape[1] >= DENSE_MIN_ROWS and calls == []
    kl, top1 = kl_top1(base, out)
    assert kl < 1e-3 and top1 >= 0.95, (kl, top1)
    with torch.no_grad():
        m(ids[:, :1])  # one row: the int4 kernel
    assert len(calls) == len(layers) and all(shape[0] == 1 for shape in calls)
    calls.clear()
    gen = m.generate(ids, max_new_tokens=8, do_sample=False)
    assert gen.shape == (1, 32)
    assert len(calls) == 7 * len(layers)  # the prompt through the copies, the 7 decode forwards through the kernel


def test_cuda_packing_reads_back_the_cpu_codes():
    on_cpu = quantize_(tiny_model("llama"), Int4WeightOnly(group_size=32))
    on_gpu = quantize_(tiny_model("llama").cuda(), Int4WeightOnly(group_size=32))
    assert {mod.layout for mod in int4_layers(on_gpu)} == {"cuda_tinygemm"}
    cpu_state, gpu_state = on_cpu.state_dict(), on_gpu.state_dict()
    keys = [k for k in cpu_state if k.endswith(("qweight", "scales", "zeros"))]
    assert len(keys) == 3 * 14
    for k in keys:  # the same round-to-nearest codes, recovered from either kernel's packing
        if k.endswith("qweight"):
            assert torch.equal(gpu_state[k].cpu(), cpu_state[k]), k
        elif k.endswith("scales"):
            torch.testing.assert_close(gpu_state[k].cpu(), cpu_state[k], rtol=1e-6, atol=1e-6, msg=k)
    # both kernels keep the offset (8 - zero) * scale in bf16, computed on their own device; the zeros read back
    # from it may differ by the offset's last bf16 bit, far below one quantization step (a wrong zero moves the
    # group's weights by a whole scale)
    for a, b in zip(int4_layers(on_cpu), int4_layers(on_gpu), strict=True):
        step = float(a.state_dict()["scales"].max())  # the largest quantization step
        torch.testing.assert_close(b.dequantize().cpu(), a.dequantize(), rtol=0, atol=step * 2**-4)
