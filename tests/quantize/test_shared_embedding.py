"""share_embedding: a tied input embedding reads its rows from the int8 output head's codes."""

import pytest
import torch

import infopt
from infopt.core.errors import RecipeError
from infopt.core.introspect import param_bytes
from infopt.models import tiny_model
from infopt.quantize import Int4WeightOnly, Int8WeightOnly, quantize_
from infopt.quantize.formats.int8 import Int8Linear, SharedInt8Embedding

CONFIGS = {
    "int4-a8": dict(method="int4", group_size=32, include_lm_head=True, activations="int8", share_embedding=True),
    "int4": dict(method="int4", group_size=32, include_lm_head=True, share_embedding=True),
    "int8": dict(method="int8", include_lm_head=True, share_embedding=True),
    "int8-grouped": dict(method="int8", group_size=32, include_lm_head=True, share_embedding=True),
}
IDS = torch.tensor([[1, 5, 9, 200, 4000, 49151], [7, 7, 3, 2, 1, 0]])


def _optimized(arch="llama", name="int4-a8"):
    torch.manual_seed(0)
    m = tiny_model(arch)
    infopt.optimize(m, [{"quantize": dict(CONFIGS[name])}])
    return m


@pytest.mark.parametrize("name", list(CONFIGS))
def test_lookups_are_the_heads_dequantized_rows(name):
    m = _optimized(name=name)
    emb = m.get_input_embeddings()
    assert isinstance(emb, SharedInt8Embedding) and emb.head is m.lm_head and isinstance(m.lm_head, Int8Linear)
    assert torch.equal(emb(IDS), m.lm_head.dequantize()[IDS])
    assert not list(emb.parameters()) and not list(emb.buffers())  # the head owns the codes


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_the_model_is_the_one_whose_embedding_holds_the_heads_values(arch):
    """The only change against the head-quantized model is the embedding's weight: the same logits as a model whose
    float embedding was overwritten by the head's dequantized weight (Gemma 3's scaled embedding included)."""
    shared = _optimized(arch)
    torch.manual_seed(0)
    ref = tiny_model(arch)
    cfg = dict(CONFIGS["int4-a8"], share_embedding=False)
    infopt.optimize(ref, [{"quantize": cfg}])
    with torch.no_grad():
        ref.get_input_embeddings().weight.copy_(ref.lm_head.dequantize())
    assert torch.equal(shared(IDS).logits, ref(IDS).logits)


def test_the_embeddings_memory_goes_and_undo_brings_the_tied_model_back():
    torch.manual_seed(0)
    m = tiny_model()
    original = {k: v.clone() for k, v in m.state_dict().items()}
    cfg = dict(CONFIGS["int4-a8"])
    cfg.pop("method")
    quantize_(m, Int4WeightOnly(**{**cfg, "share_embedding": False}))
    unshared = param_bytes(m)
    infopt.undo(m)
    quantize_(m, Int4WeightOnly(**cfg))
    assert unshared - param_bytes(m) == m.config.vocab_size * m.config.hidden_size * 4
    infopt.undo(m)
    assert type(m.model.embed_tokens) is torch.nn.Embedding and m.lm_head.weight is m.model.embed_tokens.weight
    assert all(torch.equal(v, original[k]) for k, v in m.state_dict().items())


def test_an_untied_embedding_keeps_its_weight_and_the_report_says_so():
    torch.manual_seed(0)
    m = tiny_model("mistral")
    assert m.lm_head.weight is not m.model.embed_tokens.weight
    infopt.optimize(m, [{"quantize": dict(CONFIGS["int8"])}])
    assert type(m.model.embed_tokens) is torch.nn.Embedding and isinstance(m.lm_head, Int8Linear)
    assert "the embedding keeps its weight" in str(m.infopt)


def test_the_flag_needs_an_int8_head():
    with pytest.raises(RecipeError, match="include_lm_head=True and lm_head_bits=8"):
        Int4WeightOnly(group_size=32, include_lm_head=True, lm_head_bits=4, share_embedding=True)
    with pytest.raises(RecipeError, match="needs include_lm_head=True"):
        Int8WeightOnly(share_embedding=True)
    with pytest.raises(RecipeError, match="share_embedding"):
        Int8WeightOnly(include_lm_head=True, share_embedding="yes")


def test_saved_models_load_back_shared_and_in_plain_transformers_with_the_same_numbers(tmp_path):
    from transformers import AutoModelForCausalLM

    m = _optimized()
    want = m(IDS).logits
    infopt.save_optimized(m, tmp_path / "saved")
    loaded, _ = infopt.load(tmp_path / "saved")
    assert isinstance(loaded.get_input_embeddings(), SharedInt8Embedding)
    assert loaded.get_input_embeddings().head is loaded.lm_head
    assert torch.equal(loaded(IDS).logits, want)
    # neither folder holds the embedding (it is the int8 head's codes, rebuilt from them at load): the saved folder
    # is about the model's size in memory; the live state dict still shows the float values of the codes
    from safetensors.torch import load_file

    assert "model.embed_tokens.weight" not in load_file(str(tmp_path / "saved" / "infopt_model.safetensors"))
    assert torch.equal(m.state_dict()["model.embed_tokens.weight"], m.lm_head.dequantize())
    m.save_pretrained(tmp_path / "hf")
    saved = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert "model.embed_tokens.weight" not in saved
    folder_bytes = sum(f.stat().st_size for f in (tmp_path / "saved").rglob("*.safetensors"))
    assert folder_bytes < 1.2 * sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers()))
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert isinstance(plain.get_input_embeddings(), SharedInt8Embedding)
    assert plain.get_input_embeddings().head is plain.lm_head
    assert torch.equal(plain(IDS).logits, want)


def test_a_wrong_shaped_saved_embedding_is_refused():
    m = _optimized()
    sd = m.state_dict()
    sd["model.embed_tokens.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match=r"model.embed_tokens.weight: shape \(3, 3\)"):
        m.load_state_dict(sd)


def test_greedy_generate_equals_the_reference_models():
    shared = _optimized()
    torch.manual_seed(0)
    ref = tiny_model()
    infopt.optimize(ref, [{"quantize": dict(CONFIGS["int4-a8"], share_embedding=False)}])
    with torch.no_grad():
        ref.get_input_embeddings().weight.copy_(ref.lm_head.dequantize())
    kw = dict(max_new_tokens=12, do_sample=False)
    assert torch.equal(shared.generate(IDS[:1], **kw), ref.generate(IDS[:1], **kw))
