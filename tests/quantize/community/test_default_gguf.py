"""The shipped SmolLM2 Q4_1 GGUF straight onto Int4Linear layers, against transformers' dequantized fp32 load."""

from __future__ import annotations

import pytest
import torch

from infopt.core.introspect import param_bytes
from infopt.quantize import Int4Linear

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def reference(default_model):
    from infopt.eval import reference_logits

    model, tok = default_model
    return reference_logits(model, tokenizer=tok, max_tokens=128)


def test_reference_path_holds_the_files_weights(default_model):
    from infopt.models import default_gguf_path
    from infopt.quantize.community import load_quantized

    dense, _ = default_model
    model, _ = load_quantized(default_gguf_path(), reference=True, tokenizer=False)
    # q/k carry llama.cpp's row permutation, undone on the quantized rows; a layer at each end of the stack
    for i in (0, 29):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"):
            got = model.model.layers[i].get_submodule(name)
            want = dense.model.layers[i].get_submodule(name).weight
            assert got.layout == "plain"
            torch.testing.assert_close(got.dequantize(), want, rtol=1e-5, atol=1e-6 * float(want.detach().abs().max()))
    assert torch.equal(model.model.embed_tokens.weight, dense.model.embed_tokens.weight)


def test_load_default_quantized(default_model, reference):
    from infopt.eval import compare
    from infopt.models import default_gguf_path, load_default

    dense, dense_tok = default_model
    model, tok = load_default(quantized=True)
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 30 * 7 and all(m.group_size == 32 for m in layers)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, dense (the file's Q8_0 embedding)
    # the int4 kernel takes bf16 activations: KL 2.8e-4, top-1 99.6% measured on 256 tokens
    fig = compare(model, reference)
    assert fig["kl"] < 2e-3 and fig["top1"] >= 0.97
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ref_enc = dense_tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert torch.equal(enc["input_ids"], ref_enc["input_ids"]) and tok.eos_token_id == 2
    out = model.generate(enc["input_ids"], max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    # fp32: int4 layers + scales (~66 MB) and the dense fp32 embedding tied to the head (113 MB)
    file_bytes = default_gguf_path().stat().st_size
    emb = model.model.embed_tokens.weight
    quantized_part = param_bytes(model) - emb.numel() * emb.element_size()
    assert quantized_part <= 0.7 * file_bytes
    # with dtype=torch.bfloat16 the same layers and a bf16 embedding: within 1.3x the file (docs: 123 MB / 98 MB)
    assert quantized_part + emb.numel() * 2 <= 1.3 * file_bytes
    assert param_bytes(dense) > 5 * file_bytes
