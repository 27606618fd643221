"""The CPU kernels of the quantized layers are counted, so a test can tell that the kernel ran where its fallback
would give the same numbers: ``Int4Linear`` per layout, ``Int8Linear`` per path, the C++ operators of
``infopt.quantize.formats.a8`` (``kernel_calls()`` of each module; ``infopt.compile.packed``'s in tests/compile/test_packed.py).
"""

import pytest
import torch
from torch import nn

from infopt.models import tiny_model
from infopt.quantize import Int4WeightOnly, Int8WeightOnly, quantize_
from infopt.quantize.formats import a8, int4, int8
from infopt.quantize.formats.int4 import Int4Linear
from infopt.quantize.formats.int8 import Int8Linear
from tests.fresh_thread import in_fresh_thread

kernel = pytest.mark.skipif(not a8.available(), reason="the C++ quant_linear kernel cannot be built here")
IDS = torch.tensor([[1, 17, 400, 23, 9, 1200]])


def _delta(counter, before: dict) -> dict:
    """``counter()`` minus ``before``, keeping only the kernels that ran."""
    return {k: v - before[k] for k, v in counter().items() if v != before[k]}


def _layers(model, cls) -> list:
    return [m for m in model.modules() if isinstance(m, cls)]


@pytest.mark.parametrize("module", [a8, int4, int8], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_each_counter_lists_its_kernels(module):
    assert sorted(module.kernel_calls()) == sorted(module.KERNELS)
    assert {"kernel_calls", "KERNELS"} <= set(module.__all__)
    assert all(v >= 0 for v in module.kernel_calls().values())


@kernel
def test_int8_activations_on_the_cpu_run_the_a8_kernels_not_their_reference(monkeypatch):
    """``Int4WeightOnly(activations="int8")`` with the C++ extension built: every int4 layer ran the ``a8`` layout's
    C++ operator and the int8 head its own; the reference, switched in by hand, gives the same numbers (so only the
    counts can tell them apart)."""
    model = quantize_(tiny_model(), Int4WeightOnly(group_size=32, activations="int8", include_lm_head=True))
    n = len(_layers(model, Int4Linear))
    assert n == 14 and isinstance(model.lm_head, Int8Linear) and model.lm_head.activations == "int8"
    b4, b8, ba = int4.kernel_calls(), int8.kernel_calls(), a8.kernel_calls()
    with torch.no_grad():
        fast = model(IDS).logits
    assert _delta(int4.kernel_calls, b4) == {"a8": n}
    assert _delta(int8.kernel_calls, b8) == {"int8_a8_linear": 1}
    assert _delta(a8.kernel_calls, ba) == {"int4_a8_linear": n, "int8_a8_linear": 1}
    monkeypatch.setattr(a8, "available", lambda: False)  # as where the extension cannot be built
    ba = a8.kernel_calls()
    with torch.no_grad():
        slow = model(IDS).logits
    assert _delta(a8.kernel_calls, ba) == {"reference": n + 1}
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-4)


@kernel
def test_a8_prompts_dequantize_on_the_cpp_kernel_where_bf16_gemms_are_native(monkeypatch):
    monkeypatch.setattr(int4, "_FAST_BF16", [True])
    layer = Int4Linear.from_float(nn.Linear(64, 32), group_size=32, layout="a8")
    b4, ba = int4.kernel_calls(), a8.kernel_calls()
    with torch.no_grad():
        layer(torch.randn(int4.A8_PROMPT_MIN_ROWS, 64))
        layer(torch.randn(int4.A8_PROMPT_MIN_ROWS - 1, 64))
    assert _delta(int4.kernel_calls, b4) == {"a8_prompt": 1, "a8": 1}
    assert _delta(a8.kernel_calls, ba) == {"int4_a8_dense_t": 1, "int4_a8_linear": 1}


@pytest.mark.skipif(int4.layout_for(torch.device("cpu"), 64, 64, 32) != "cpu_int4pack",
                    reason="this torch has no CPU int4 kernel (torch._weight_int4pack_mm_for_cpu)")
def test_int4_float_activations_run_torchs_cpu_int4_kernel_and_dense_copies_serve_prompts():
    """Float activations on CPU: torch's int4 kernel, which computes what the ``plain`` reference layout computes
    within bf16 activations; with ``dense_prefill`` the rows from the copy's threshold on take the copy."""
    torch.manual_seed(0)
    lin = nn.Linear(256, 128)
    fast = Int4Linear.from_float(lin, group_size=32)
    plain = Int4Linear.from_float(lin, group_size=32, layout="plain")
    x = torch.randn(3, 256)
    before = int4.kernel_calls()
    with torch.no_grad():
        y, want = fast(x), plain(x)
    assert _delta(int4.kernel_calls, before) == {"cpu_int4pack": 1, "plain": 1}
    assert float(10 * torch.log10(want.pow(2).mean() / (y - want).pow(2).mean())) > 30
    fast.enable_dense()
    rows = int4.DENSE_MIN_ROWS if fast.weight_dense.dtype == torch.bfloat16 else int4.DENSE_FP32_MIN_ROWS
    before = int4.kernel_calls()
    with torch.no_grad():
        fast(torch.randn(rows, 256))
        fast(torch.randn(rows - 1, 256))
    assert _delta(int4.kernel_calls, before) == {"dense": 1, "cpu_int4pack": 1}


@kernel
def test_int8_fp32_layers_run_the_int8_f32_kernel_not_the_dequantized_weight(monkeypatch):
    """``Int8WeightOnly(compute_dtype="float32")``: every layer on infopt's C++ int8 x fp32 operator; without the
    extension the weight dequantized a chunk of rows at a time, the same product within fp32 reordering."""
    model = quantize_(tiny_model(), Int8WeightOnly(compute_dtype="float32"))
    n = len(_layers(model, Int8Linear))
    before = int8.kernel_calls()
    with torch.no_grad():
        fast = model(IDS).logits
    assert n == 14 and _delta(int8.kernel_calls, before) == {"int8_f32_linear": n}
    monkeypatch.setattr(a8, "available", lambda: False)
    before = int8.kernel_calls()
    with torch.no_grad():
        slow = model(IDS).logits
    assert _delta(int8.kernel_calls, before) == {"dequantized_chunks": n}
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)


def test_int8_fp32_chunks_share_their_buffer_in_and_out_of_inference_mode(monkeypatch):
    """Without the extension, the chunked path's per-thread buffer is first made under ``torch.inference_mode``
    (as serving code often runs) and written again outside it: both products are the same. In a new thread, whose buffer is
    new."""
    model = quantize_(tiny_model(), Int8WeightOnly(compute_dtype="float32"))
    monkeypatch.setattr(a8, "available", lambda: False)

    def calls():
        with torch.inference_mode():
            first = model(IDS).logits
        with torch.no_grad():
            return first, model(IDS).logits

    first, second = in_fresh_thread(calls)
    assert torch.equal(first, second)


def test_int8_bf16_and_int8_activation_layers_are_counted_on_their_kernels():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    bf16 = Int8Linear.from_float(lin, compute_dtype="bfloat16")
    a8_layer = Int8Linear.from_float(lin, activations="int8")
    before, ba = int8.kernel_calls(), a8.kernel_calls()
    with torch.no_grad():
        bf16(torch.randn(2, 64))
        a8_layer(torch.randn(2, 64))
    assert _delta(int8.kernel_calls, before) == {"weight_int8pack_mm": 1, "int8_a8_linear": 1}
    assert _delta(a8.kernel_calls, ba) == {"int8_a8_linear" if a8.available() else "reference": 1}


@pytest.mark.parametrize("layout", ["a8", "cpu_int4pack", "plain"])
def test_compiled_forwards_are_not_counted_and_do_not_recompile_on_the_count(layout):
    """A forward traced into a graph runs no Python, so the graph's calls are not counted; the count is skipped
    while tracing too, so dynamo never guards on it (one graph for every call)."""
    if layout == "a8" and not a8.available():
        pytest.skip("the C++ quant_linear kernel cannot be built here")
    if layout == "cpu_int4pack" and int4.layout_for(torch.device("cpu"), 64, 32, 32) != layout:
        pytest.skip("this torch has no CPU int4 kernel (torch._weight_int4pack_mm_for_cpu)")
    torch.manual_seed(0)
    layer = Int4Linear.from_float(nn.Linear(64, 32), group_size=32, layout=layout)
    head = Int8Linear.from_float(nn.Linear(32, 16), compute_dtype="float32")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    step = torch.compile(lambda x: head(layer(x)), backend=backend, fullgraph=True)
    x = torch.randn(2, 64)
    with torch.no_grad():
        want = head(layer(x))
        before = (int4.kernel_calls(), int8.kernel_calls(), a8.kernel_calls())
        outs = [step(x) for _ in range(3)]
    assert (int4.kernel_calls(), int8.kernel_calls(), a8.kernel_calls()) == before
    assert len(graphs) == 1
    assert all(torch.equal(o, want) for o in outs)
