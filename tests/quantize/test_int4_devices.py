"""Int4WeightOnly on each device (``cpu``, and ``cuda`` under the gpu marker): prompts through the bf16 copies and
decode steps through the device's int4 kernel (``dense_prefill``), each counted; and the device's kernel packing read
back to the portable codes."""

import torch

import infopt
from infopt.models import tiny_model
from infopt.quantize import Int4Linear, Int4WeightOnly, quantize_
from infopt.quantize.formats.int4 import DENSE_MIN_ROWS
from tests.devices import DEVICES, count_calls

from .test_calibrated_devices import kl_top1


def int4_layers(model) -> list[Int4Linear]:
    return [mod for mod in model.modules() if isinstance(mod, Int4Linear)]


def test_dense_prefill_prompts_in_bf16_decode_steps_in_the_kernel(monkeypatch, device):
    dev = DEVICES[device]
    m = tiny_model("llama", dtype=torch.bfloat16).to(device)
    ids = torch.randint(3, 40_000, (1, 24), generator=torch.Generator().manual_seed(7)).to(device)
    with torch.no_grad():
        base = m(ids).logits
    infopt.optimize(m, [Int4WeightOnly(group_size=32, dense_prefill=True)])
    layers = int4_layers(m)
    assert len(layers) == 14 and {mod.layout for mod in layers} == {dev.int4_layout}
    assert all(mod.weight_dense.device.type == device and mod.weight_dense.dtype == torch.bfloat16 for mod in layers)
    calls = count_calls(monkeypatch, "torch", dev.int4_op)
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


def test_device_packing_reads_back_the_portable_codes(device):
    """Quantized on the device, each layer's kernel packing reads back (``state_dict``) the round-to-nearest codes of
    the portable layout exactly, its scales as the bf16 values the kernel keeps, and zeros within the bf16 rounding
    of the offset (a wrong zero moves the group's weights by a whole scale)."""
    base = tiny_model("llama")
    on_device = quantize_(tiny_model("llama").to(device), Int4WeightOnly(group_size=32))
    layers = {name: mod for name, mod in on_device.named_modules() if isinstance(mod, Int4Linear)}
    assert len(layers) == 14 and {mod.layout for mod in layers.values()} == {DEVICES[device].int4_layout}
    for name, layer in layers.items():
        plain = Int4Linear.from_float(base.get_submodule(name), group_size=32, layout="plain")
        state = {k: v.cpu() for k, v in layer.state_dict().items()}
        assert torch.equal(state["qweight"], plain.qweight), name
        torch.testing.assert_close(state["scales"], plain.scales.to(torch.bfloat16).float(), rtol=1e-6, atol=1e-6,
                                   msg=name)
        # the kernel keeps the offset (8 - zero) * scale in bf16: the zeros read back from it may differ by its last
        # bf16 bit, far below one quantization step
        step = float(plain.scales.max())  # the largest quantization step
        torch.testing.assert_close(layer.dequantize().cpu(), plain.dequantize(), rtol=0, atol=step * 2**-4, msg=name)
