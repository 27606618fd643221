import pytest
import torch
from safetensors.torch import load_file

import infopt
from infopt.core.errors import IncompatibleModelError
from infopt.models import tiny_model
from infopt.quantize import Int4Linear, Int4WeightOnly
from infopt.quantize.serialization.export import (
    _pack_rows,
    dequantize_gptq,
    export_gptq,
    gptq_tensors,
    load_gptq_state,
    unpack_words,
)


def test_pack_rows_roundtrip():
    codes = torch.randint(0, 16, (32, 24))
    words = _pack_rows(codes)
    assert words.dtype == torch.int32 and words.shape == (4, 24)
    assert torch.equal(unpack_words(words, 4, 0).long(), codes)


def test_layer_layout_dequantizes_to_the_same_weight():
    lin = torch.nn.Linear(128, 64, bias=True)
    q = Int4Linear.from_float(lin, group_size=32, zero_point="int")
    t = gptq_tensors(q)
    assert t["qweight"].shape == (16, 64) and t["qzeros"].shape == (4, 8) and t["scales"].shape == (4, 64)
    assert torch.equal(t["g_idx"], (torch.arange(128) // 32).int())
    # scales pass through bf16 (kernel) and fp16 (format): equal to fp16 rounding
    assert torch.allclose(dequantize_gptq(t), q.dequantize(), rtol=2e-3, atol=1e-6)


def test_permuted_layer_exports_g_idx():
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (64, 64), dtype=torch.uint8)
    scales = torch.rand(64, 2) * 0.01 + 0.001
    zeros = torch.randint(0, 16, (64, 2)).float()
    perm = torch.randperm(64)
    q = Int4Linear.from_codes(codes, scales, zeros, group_size=32, in_perm=perm)
    t = gptq_tensors(q)
    assert sorted(t["g_idx"].tolist()) == [0] * 32 + [1] * 32
    # the kernel keeps (8 - zero) * scale in bf16: within a few hundredths of a step
    assert (dequantize_gptq(t) - q.dequantize()).abs().max() < 0.05 * scales.max()
    # and the export holds the exact integer zero points and codes, in input-channel order
    ref = (codes.float() - zeros.repeat_interleave(32, 1)) * scales.repeat_interleave(32, 1)
    ref_orig = torch.empty_like(ref)
    ref_orig[:, perm] = ref
    assert torch.allclose(dequantize_gptq(t), ref_orig, rtol=1e-2, atol=1e-6)


def test_float_zero_points_refused():
    q = Int4Linear.from_float(torch.nn.Linear(64, 32), group_size=32, zero_point="float")
    with pytest.raises(IncompatibleModelError, match="zero_point='int'"):
        gptq_tensors(q)


def test_export_reads_back_to_the_same_logits(tmp_path, prompt):
    m = tiny_model("llama")
    infopt.optimize(m, [Int4WeightOnly(group_size=32, zero_point="int")])
    export_gptq(m, tmp_path / "gptq")
    raw = load_file(str(tmp_path / "gptq" / "model.safetensors"))
    assert "model.layers.0.mlp.up_proj.qweight" in raw and "model.layers.0.mlp.up_proj.g_idx" in raw
    dense = tiny_model("llama")
    missing, unexpected = dense.load_state_dict(load_gptq_state(tmp_path / "gptq"), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    ref = m(prompt).logits
    out = dense(prompt).logits
    # the int4 model computes with bf16 activations; the dense read-back in fp32
    assert torch.nn.functional.cosine_similarity(ref.flatten(), out.flatten(), dim=0) > 0.999


def test_int8_head_is_refused(tmp_path):
    m = tiny_model("llama")
    infopt.optimize(m, [Int4WeightOnly(group_size=32, zero_point="int", include_lm_head=True)])
    with pytest.raises(IncompatibleModelError, match="lm_head is an Int8Linear"):
        export_gptq(m, tmp_path / "x")
