import pytest
import torch

import infopt
from infopt.attention import Attention
from infopt.core.errors import IncompatibleModelError, RecipeError
from infopt.core.introspect import inspect_model
from infopt.eval import assert_same_tokens, greedy_outputs
from infopt.generate import routing_stats
from infopt.kvcache import HeavyHitter, use_
from infopt.kvcache.heavy_hitter_cache import HeavyHitterLayer
from infopt.models import tiny_model
from infopt.recipe import Recipe

from ..conftest import assert_state_equal, state_snapshot

PROMPTS = [[1, 17, 400, 23, 9, 1200, 5], [4, 4, 8, 15, 16, 23, 42, 7]]


def tiny(arch: str = "llama", **kw):
    """A tiny model with a 2,048-token vocabulary (the output head dominates a tiny model's step otherwise)."""
    return tiny_model(arch, vocab_size=2048, **kw)


def spy_caches(monkeypatch) -> list:
    made = []
    new_cache = HeavyHitter.new_cache
    monkeypatch.setattr(HeavyHitter, "new_cache", lambda self, model: made.append(new_cache(self, model)) or made[-1])
    return made


# -- config validation -------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, bad", [
    ({"budget": 0}, "budget"), ({"budget": -8}, "budget"), ({"budget": True}, "budget"), ({"budget": 8.0}, "budget"),
    ({"budget": 16, "recent": -1}, "recent"), ({"budget": 16, "recent": 17}, "recent"),
    ({"budget": 16, "recent": "4"}, "recent"),
], ids=lambda v: str(v))
def test_bad_fields_refused(fields, bad):
    with pytest.raises(RecipeError, match=f"HeavyHitter.{bad}="):
        HeavyHitter(**fields)


def test_non_eager_attention_step_refused_model_untouched():
    m = tiny()
    snap = state_snapshot(m)
    with pytest.raises(RecipeError, match="only the eager backend returns"):
        infopt.optimize(m, [Attention("sdpa"), HeavyHitter(budget=16, recent=4)])
    with pytest.raises(IncompatibleModelError, match="eager"):  # the step's own check, without the rules
        HeavyHitter().check(m, inspect_model(m), (Attention("sdpa"), HeavyHitter()))
    assert "generate" not in m.__dict__ and m.config._attn_implementation == "sdpa"
    assert_state_equal(m, snap)
    infopt.optimize(m, [Attention("eager"), HeavyHitter(budget=16, recent=4)])
    assert m.infopt.fallbacks == []


def test_sliding_window_model_refused():
    with pytest.raises(IncompatibleModelError, match="sliding_attention"):
        use_(tiny("gemma3"), HeavyHitter())


def test_recipe_spelling_round_trip():
    r = Recipe.parse({"steps": [{"kvcache": {"kind": "heavy_hitter", "budget": 128}}, {"attention": "eager"}]})
    assert r.steps == (Attention("eager"), HeavyHitter(budget=128, recent=64))
    assert Recipe.from_yaml(r.to_yaml()) == r
    assert r.steps[1].to_dict() == {"kvcache": {"kind": "heavy_hitter", "budget": 128, "recent": 64}}


def test_optimize_switches_to_eager_and_undo_restores():
    m = tiny()
    original = m.generate
    ref = greedy_outputs(m, PROMPTS, 24)
    infopt.optimize(m, [HeavyHitter(budget=16, recent=4)])
    assert m.config._attn_implementation == "eager"
    assert m.infopt.fallbacks == ["kvcache:heavy_hitter: attention backend sdpa -> eager (H2O reads the attention "
                                  "weights, which only eager returns)"]
    assert "switched to eager" in m.infopt.steps[0].notes[0]
    attn = [m.get_submodule(f"model.layers.{i}.self_attn") for i in range(2)]
    assert all(len(a._forward_hooks) == 1 for a in attn)
    assert greedy_outputs(m, PROMPTS, 24) != ref  # 31 tokens through a 16-token budget: lossy
    infopt.undo(m)
    assert m.config._attn_implementation == "sdpa"
    assert "generate" not in m.__dict__ and m.generate == original
    assert all(not a._forward_hooks for a in attn)
    assert_same_tokens(ref, greedy_outputs(m, PROMPTS, 24))


# -- exactness within the budget, bounded beyond ---------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma", "gpt2"])
def test_greedy_identical_while_within_budget(arch):
    m = tiny(arch, attn_implementation="eager")
    new = 32 - len(PROMPTS[1])  # prompt + new tokens <= budget: nothing evicted
    ref = greedy_outputs(m, PROMPTS, new)
    use_(m, HeavyHitter(budget=32, recent=8))
    assert_same_tokens(ref, greedy_outputs(m, PROMPTS, new))
    assert routing_stats(m).infopt == len(PROMPTS)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_cache_bounded_beyond_budget(arch, monkeypatch):
    m = use_(tiny(arch), HeavyHitter(budget=16, recent=4))
    made = spy_caches(monkeypatch)
    ids = torch.tensor([PROMPTS[0]] * 2)  # an unpadded batch: rows evict independently
    out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=60, do_sample=False)
    assert out.shape == (2, 67)
    (cache,) = made
    assert cache.get_seq_length() == 66  # every token seen; positions stay the true ones
    assert all(layer.keys.shape[0] == 2 and layer.keys.shape[2] == 16 for layer in cache.layers)
    assert cache.memory_bytes().tokens == 16


def test_memory_flat_in_a_hand_written_loop():
    m = use_(tiny(), HeavyHitter(budget=12, recent=4))
    cache = HeavyHitter(budget=12, recent=4).new_cache(m)
    sizes = []
    with torch.no_grad():
        for i, t in enumerate(torch.randint(3, 1000, (40,))):
            m(t.view(1, 1), past_key_values=cache, position_ids=torch.tensor([[i]]))
            sizes.append(cache.memory_bytes().allocated)
    assert len(set(sizes[11:])) == 1
    assert cache.get_seq_length() == 40


def test_prompt_longer_than_budget_evicted_after_prefill():
    m = use_(tiny(), HeavyHitter(budget=8, recent=2))
    cache = HeavyHitter(budget=8, recent=2).new_cache(m)
    with torch.no_grad():
        m(torch.randint(3, 1000, (1, 30)), past_key_values=cache)
        assert [layer.keys.shape[-2] for layer in cache.layers] == [8, 8]
        m(torch.randint(3, 1000, (1, 3)), past_key_values=cache)  # a 3-token chunk after eviction
    assert cache.get_seq_length() == 33 and cache.layers[0].keys.shape[-2] == 8


# -- eviction rule -----------------------------------------------------------------------------------


def test_keeps_recent_and_heaviest_per_head():
    layer = HeavyHitterLayer(budget=4, recent=2)
    # keys/values hold their token index; 2 KV heads, 4 query heads (GQA 2)
    k = torch.arange(6.0).view(1, 1, 6, 1).expand(1, 2, 6, 3).contiguous()
    layer.update(k, k.clone())
    w = torch.zeros(1, 4, 6, 6)
    w[:, 0:2, :, 1] = 0.5  # KV head 0's query heads attend to token 1 ...
    w[:, 0:2, :, 3] = 0.3  # ... and 3
    w[:, 2:4, :, 0] = 0.9  # KV head 1's to token 0 ...
    w[:, 2:4, :, 2] = 0.1  # ... and 2
    layer.observe(w)
    assert layer.keys[0, 0, :, 0].tolist() == [1, 3, 4, 5]  # heaviest two in order, then the two most recent
    assert layer.keys[0, 1, :, 0].tolist() == [0, 2, 4, 5]
    assert torch.equal(layer.values, layer.keys)
    assert layer.scores.shape == (1, 2, 4) and layer.get_seq_length() == 6
    assert layer.get_mask_sizes(1) == (5, 2)  # 4 held + 1 new; offset lines up with the 6 tokens seen


def test_backend_switched_away_falls_back_and_hook_refuses_missing_weights():
    m = use_(tiny(), HeavyHitter(budget=16, recent=4))
    m.set_attn_implementation("sdpa")
    m.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=3, do_sample=False)
    stats = routing_stats(m)
    assert stats.original == 1 and any("returns no attention weights" in r for r in stats.reasons)
    cache = HeavyHitter(budget=16, recent=4).new_cache(m)
    with torch.no_grad(), pytest.raises(RuntimeError, match="eager"):
        m(torch.tensor([PROMPTS[0]]), past_key_values=cache)


def test_padded_batch_falls_back():
    m = use_(tiny(), HeavyHitter(budget=16, recent=4))
    ids = torch.tensor([[2, 2, 5, 6, 7], [8, 9, 10, 11, 12]])
    m.generate(ids, attention_mask=torch.tensor([[0, 0, 1, 1, 1], [1] * 5]), max_new_tokens=3, pad_token_id=2)
    assert any("padded batch" in r for r in routing_stats(m).reasons)
