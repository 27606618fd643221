"""Configs, recipe spellings, validation, routing of unsupported calls, stats, and undo."""

import pytest
import torch

import infopt
from infopt.core.errors import RecipeError
from infopt.generate import routing_stats
from infopt.kvcache import Static
from infopt.models import tiny_model
from infopt.recipe import Recipe
from infopt.speculative import DraftModel, PromptLookup, SelfDraft, build_self_draft, enable_, stats
from tests.conftest import assert_state_equal, state_snapshot


@pytest.mark.parametrize("spelling,expected", [
    ({"speculative": {"method": "prompt_lookup", "num_tokens": 6, "ngram": [2, 4]}}, PromptLookup(6, (2, 4))),
    ({"speculative": {"method": "self_draft", "quantize": "int8", "num_tokens": "adaptive"}},
     SelfDraft(quantize="int8")),
    ({"speculative": {"method": "self_draft", "num_layers": 4, "quantize": {
        "method": "int4", "group_size": 32, "include_lm_head": True, "activations": "auto"}}},
     SelfDraft(quantize="int4", num_layers=4)),
    ({"speculative": {"method": "draft_model", "draft": "default", "num_tokens": 4}}, DraftModel("default", 4)),
], ids=["lookup", "self-int8", "self-int4-layers", "draft-default"])
def test_recipe_spellings_round_trip(spelling, expected):
    r = Recipe.parse({"steps": [spelling]})
    assert r.steps == (expected,)
    assert Recipe.from_yaml(r.to_yaml()) == r


@pytest.mark.parametrize("bad,field", [
    ({"method": "prompt_lookup", "num_tokens": 0}, "num_tokens"),
    ({"method": "prompt_lookup", "num_tokens": "fast"}, "num_tokens"),
    ({"method": "prompt_lookup", "ngram": [3, 1]}, "ngram"),
    ({"method": "self_draft", "quantize": "int3"}, "quantize"),
    ({"method": "self_draft", "num_layers": 0}, "num_layers"),
    ({"method": "self_draft", "quantize": None}, "num_layers"),
    ({"method": "draft_model", "draft": 3}, "draft"),
    ({"method": "beam"}, "method"),
])
def test_bad_configs_name_the_field(bad, field):
    with pytest.raises(RecipeError, match=field):
        Recipe.parse({"steps": [{"speculative": bad}]})


@pytest.mark.parametrize("other", ["sinks", "heavy_hitter", "quantized", "paged"])
def test_rules_refuse_caches_that_cannot_roll_back(other):
    with pytest.raises(RecipeError, match="speculative"):
        Recipe.parse({"steps": [{"kvcache": {"kind": other}}, {"speculative": {"method": "prompt_lookup"}}]})


def test_self_draft_num_layers_checked_against_model():
    m = tiny_model(num_layers=2)
    snap = state_snapshot(m)
    with pytest.raises(infopt.IncompatibleModelError, match="num_layers"):
        infopt.optimize(m, [SelfDraft(quantize=None, num_layers=5)])
    assert_state_equal(m, snap)
    assert "generate" not in m.__dict__


def test_undo_restores_exactly():
    m = tiny_model()
    snap = state_snapshot(m)
    p = torch.tensor([[1, 17, 400, 23, 9, 1200, 5]])
    before = m(p).logits
    infopt.optimize(m, [SelfDraft(quantize="int8", num_tokens=2)])
    m.generate(p, max_new_tokens=6, do_sample=False)
    infopt.undo(m)
    assert "generate" not in m.__dict__ and stats(m) == {}
    assert_state_equal(m, snap)
    assert torch.equal(m(p).logits, before)


def test_self_draft_shares_target_tensors_and_leaves_target_intact():
    m = tiny_model(num_layers=3)
    snap = state_snapshot(m)
    draft, extra = build_self_draft(m, SelfDraft(quantize="int8", num_layers=2))
    assert_state_equal(m, snap)
    assert len(draft.model.layers) == 2 and draft.config.num_hidden_layers == 2 and m.config.num_hidden_layers == 3
    assert draft.model.embed_tokens.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    assert type(draft.model.layers[0].mlp.up_proj).__name__ == "Int8Linear"
    assert type(m.model.layers[0].mlp.up_proj).__name__ == "Linear"
    quantized = [mod for mod in draft.modules() if type(mod).__name__ == "Int8Linear"]
    assert type(draft.lm_head).__name__ == "Int8Linear"  # the "int8" shorthand gives the draft its own int8 head
    int8_bytes = sum(t.numel() * t.element_size() for mod in quantized
                     for t in list(mod.parameters()) + list(mod.buffers()))
    assert extra == int8_bytes


def test_report_carries_live_stats_and_memory_note():
    m = tiny_model()
    infopt.optimize(m, [SelfDraft(quantize="int8", num_tokens=3)])
    m.generate(torch.tensor([[1, 17, 400, 23, 9]]), max_new_tokens=10, do_sample=False)
    st = m.infopt.steps[-1].stats
    assert st["tokens"] == 10 and st["drafted"] > 0
    assert 0 <= st["acceptance_rate"] <= 1 and st["target_forwards_per_token"] < 1
    assert st["draft_extra_bytes"] > 0
    assert "MiB beyond the target" in str(m.infopt)


def test_unsupported_calls_go_to_original_generate():
    ref, m = tiny_model(), tiny_model()
    enable_(m, PromptLookup(num_tokens=3))
    p = torch.tensor([[1, 17, 400, 23, 9]])
    for kw in ({"num_beams": 2}, {"bad_words_ids": [[7]]}):
        assert torch.equal(m.generate(p, max_new_tokens=5, do_sample=False, **kw),
                           ref.generate(p, max_new_tokens=5, do_sample=False, **kw))
    r = routing_stats(m)
    assert r.original == 2 and r.infopt == 0
    assert any("bad_words_ids" in k for k in r.reasons)


def test_penalty_and_stop_string_calls_decode_in_the_lean_loop_on_the_speculative_models_cache(default_tokenizer):
    """The verify does not apply penalties or stop strings per drafted position: such calls decode one token per
    step in the lean loop, on the recipe's static cache and the target's forward, with generate's tokens."""
    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=64), PromptLookup(num_tokens=3)])
    p = torch.tensor([[1, 17, 400, 23, 9, 17, 400, 23]])
    free = ref.generate(p, max_new_tokens=10, do_sample=False)
    stop = default_tokenizer.decode(free[0, p.shape[1] + 3])
    for kw in ({"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 2},
               {"stop_strings": [stop], "tokenizer": default_tokenizer}):
        assert torch.equal(m.generate(p, max_new_tokens=10, do_sample=False, **kw),
                           ref.generate(p, max_new_tokens=10, do_sample=False, **kw)), kw
    assert torch.equal(m.generate(p, max_new_tokens=10, do_sample=False), free)
    assert routing_stats(m).loops == {"lean": 3, "speculative": 1}


def test_pipeline_uses_speculative_generate():
    from transformers import pipeline

    m, tok = tiny_model(with_tokenizer=True)
    enable_(m, PromptLookup(num_tokens=3))
    pipe = pipeline("text-generation", model=m, tokenizer=tok)
    pipe("hello hello hello", max_new_tokens=5, do_sample=False)
    assert routing_stats(m).infopt == 1


def test_streamer_sees_every_token():
    class Collect:
        def __init__(self):
            self.puts = []

        def put(self, v):
            self.puts.append(v.reshape(-1).tolist())

        def end(self):
            self.puts.append("end")

    ref, m = tiny_model(), tiny_model()
    enable_(m, PromptLookup(num_tokens=4))
    p = torch.tensor([[1, 17, 400, 23, 1, 17, 400]])
    s = Collect()
    out = m.generate(p, max_new_tokens=12, do_sample=False, streamer=s)
    assert s.puts[-1] == "end" and s.puts[0] == p[0].tolist()
    assert sum(s.puts[1:-1], []) == out[0, 7:].tolist() == ref.generate(p, max_new_tokens=12, do_sample=False)[0, 7:].tolist()


def test_draft_model_on_another_device_refused_model_untouched():
    from infopt.core.errors import IncompatibleModelError

    m = tiny_model()
    with pytest.raises(IncompatibleModelError, match="draft model is on meta but the target on cpu"):
        enable_(m, DraftModel(tiny_model(num_layers=1).to("meta"), num_tokens=3))
    assert "generate" not in m.__dict__ and stats(m) == {}


def test_draft_folder_loaded_in_the_targets_dtype_and_device(tmp_path):
    from infopt.speculative import load_draft

    tiny_model(num_layers=1, seed=1).save_pretrained(tmp_path / "draft")
    draft = load_draft(str(tmp_path / "draft"), device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in draft.parameters()} == {torch.bfloat16} and not draft.training
    ref, m = tiny_model(dtype=torch.bfloat16), tiny_model(dtype=torch.bfloat16)
    enable_(m, DraftModel(str(tmp_path / "draft"), num_tokens=3))
    p = torch.tensor([[1, 17, 400, 23, 9, 1, 17]])
    assert torch.equal(m.generate(p, max_new_tokens=12, do_sample=False),
                       ref.generate(p, max_new_tokens=12, do_sample=False))
    assert stats(m)["drafted"] > 0
