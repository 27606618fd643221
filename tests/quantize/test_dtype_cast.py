"""A dtype cast of a quantized model (``model.to(torch.bfloat16)``, ``.half()``) reaches its float parts and the
dtype the quantized layers compute in, never their codes and scales (the quantized format)."""

import pytest
import torch
from torch import nn

import infopt
from infopt.models import tiny_model
from infopt.quantize import Int4WeightOnly, Int8WeightOnly
from infopt.quantize.formats import a8
from infopt.quantize.formats.fp8 import FP8Linear, fp8_dtype
from infopt.quantize.formats.int4 import Int4Linear
from infopt.quantize.formats.int8 import Int8Linear
from infopt.quantize.formats.w8a8 import W8A8Linear

kernel = pytest.mark.skipif(not a8.available(), reason="the C++ quant_linear kernel cannot be built here")


def _linear():
    torch.manual_seed(0)
    return nn.Linear(128, 64)


LAYERS = {
    "int8": lambda: Int8Linear.from_float(_linear()),
    "int8-f32": lambda: Int8Linear.from_float(_linear(), compute_dtype="float32"),
    "int8-g32": lambda: Int8Linear.from_float(_linear(), group_size=32),
    "int8-a8": pytest.param(lambda: Int8Linear.from_float(_linear(), activations="int8"), marks=kernel),
    "int4": lambda: Int4Linear.from_float(_linear(), group_size=32),
    "int4-plain": lambda: Int4Linear.from_float(_linear(), group_size=32, layout="plain"),
    "int4-a8": pytest.param(lambda: Int4Linear.from_float(_linear(), group_size=32, layout="a8"), marks=kernel),
    "int4-gemv": lambda: Int4Linear.from_float(_linear(), group_size=32, layout="gemv"),
    "w8a8": lambda: W8A8Linear.from_float(_linear()),
    "fp8": pytest.param(lambda: FP8Linear.from_float(_linear(), activations="none"),
                        marks=pytest.mark.skipif(fp8_dtype() is None, reason="this torch lacks float8_e4m3fn")),
}


@pytest.mark.parametrize("make", list(LAYERS.values()), ids=list(LAYERS))
@pytest.mark.parametrize("cast", [lambda m: m.to(torch.bfloat16), lambda m: m.half()], ids=["to-bf16", "half"])
def test_cast_keeps_the_format_and_computes_in_the_new_dtype(make, cast):
    layer = make()
    x = torch.randn(3, 128)
    with torch.no_grad():
        ref = layer(x)
    before = {n: b.clone() for n, b in layer.named_buffers()}
    cast(layer)
    dtype = layer.bias.dtype
    assert dtype in (torch.bfloat16, torch.float16)
    for name, b in layer.named_buffers():
        assert b.dtype == before[name].dtype and torch.equal(b, before[name]), name
    if hasattr(layer, "out_dtype"):
        assert layer.out_dtype == dtype
    if dtype == torch.float16 and isinstance(layer, (W8A8Linear, FP8Linear)):
        return  # (their CPU kernels take fp32 or bf16 inputs: fp16 is a GPU dtype for them)
    with torch.no_grad():
        y = layer(x.to(dtype))
    assert y.dtype == dtype
    # the same quantized weights: only the input's and output's rounding differ
    assert (y.float() - ref).norm() / ref.norm() < 2e-2
    layer.float()
    for name, b in layer.named_buffers():
        assert torch.equal(b, before[name]), name  # a round trip through bf16 leaves the format as it was


def test_meta_layer_cast_and_to_empty():
    layer = Int8Linear(128, 64, bias=True, dtype=torch.float32, compute_dtype=None, device="meta")
    layer.to(torch.bfloat16)
    assert layer.weight_scale.is_meta and layer.weight_scale.dtype == torch.float32
    layer.to_empty(device="cpu")
    assert layer.weight_scale.device.type == "cpu" and layer.weight_scale.dtype == torch.float32


@pytest.mark.parametrize("steps", [
    [Int8WeightOnly(include_lm_head=True), {"kvcache": {"kind": "static"}}],
    pytest.param([Int8WeightOnly(activations="int8")], marks=kernel),
    pytest.param([Int4WeightOnly(group_size=32, include_lm_head=True, share_embedding=True, activations="auto"),
                  {"kvcache": {"kind": "static"}}], marks=kernel),
], ids=["int8-static", "int8-a8", "int4-shared-head-static"])
def test_optimized_model_cast_to_bf16_generates_like_the_fp32_one(steps):
    # before: an int8-activation layer's kernel refused its bf16 scale, and the static cache kept its fp32 tensors
    torch.manual_seed(0)
    model = tiny_model()
    infopt.optimize(model, steps)
    ids = torch.randint(0, 100, (1, 10))
    with torch.no_grad():
        ref = model(ids).logits
    first = model.generate(ids, max_new_tokens=8, do_sample=False)  # fills the static cache in fp32
    model.to(torch.bfloat16)
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.dtype == torch.bfloat16
    assert (logits.float() - ref).norm() / ref.norm() < 3e-2
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape == first.shape
    infopt.undo(model)
