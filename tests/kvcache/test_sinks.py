import pytest
import torch

import infopt
from infopt.core.errors import IncompatibleModelError, RecipeError
from infopt.eval import assert_same_tokens, greedy_outputs
from infopt.generate import routing_stats
from infopt.kvcache import Sinks, use_
from infopt.kvcache.sinks_cache import SinkCache, rerotate, rope_inv_freq
from infopt.models import tiny_model
from infopt.recipe import Recipe

from ..conftest import assert_state_equal, state_snapshot

PROMPTS = [[1, 17, 400, 23, 9, 1200, 5], [4, 4, 8, 15, 16, 23, 42, 7]]


def tiny(arch: str = "llama", **kw):
    """A tiny model with a 2,048-token vocabulary: the output head dominates a tiny model's step otherwise."""
    return tiny_model(arch, vocab_size=2048, **kw)


# -- config validation -------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, bad", [
    ({"window": 0}, "window"), ({"window": 1}, "window"), ({"window": True}, "window"), ({"window": "64"}, "window"),
    ({"window": 16, "num_sink_tokens": -1}, "num_sink_tokens"),
    ({"window": 16, "num_sink_tokens": 16}, "num_sink_tokens"),
    ({"window": 16, "num_sink_tokens": 2.0}, "num_sink_tokens"),
], ids=lambda v: str(v))
def test_bad_fields_refused(fields, bad):
    with pytest.raises(RecipeError, match=f"Sinks.{bad}="):
        Sinks(**fields)


@pytest.mark.parametrize("arch, config, match", [
    ("gpt2", Sinks(window=16), "rotary"),
    ("gemma3", Sinks(window=16), "sliding_attention"),
    ("llama", Sinks(window=1024), "512 positions"),
], ids=["gpt2-no-rope", "gemma3-sliding", "window-past-context"])
def test_incompatible_models_refused_untouched(arch, config, match):
    m = tiny(arch)
    snap = state_snapshot(m)
    with pytest.raises(IncompatibleModelError, match=match):
        infopt.optimize(m, [config])
    assert "generate" not in m.__dict__ and not m._forward_pre_hooks
    assert_state_equal(m, snap)


def test_recipe_spelling_round_trip():
    r = Recipe.parse({"kvcache": {"kind": "sinks", "window": 64}})
    assert r.steps == (Sinks(window=64, num_sink_tokens=4),)
    assert Recipe.from_yaml(r.to_yaml()) == r
    assert r.steps[0].to_dict() == {"kvcache": {"kind": "sinks", "window": 64, "num_sink_tokens": 4}}


def test_optimize_and_undo():
    m = tiny("llama")
    original = m.generate
    ref = greedy_outputs(m, PROMPTS, 30)
    infopt.optimize(m, [Sinks(window=16, num_sink_tokens=2)])
    assert "generate" in m.__dict__ and len(m._forward_pre_hooks) == 1
    step = m.infopt.steps[0]
    assert step.stats["kv_window_tokens"] == 16 and "flat" in step.notes[0]
    assert greedy_outputs(m, PROMPTS, 30) != ref  # 37 tokens through a 16-token window: it is lossy
    infopt.undo(m)
    assert "generate" not in m.__dict__ and m.generate == original and not m._forward_pre_hooks
    assert_same_tokens(ref, greedy_outputs(m, PROMPTS, 30))


# -- exactness within the window ---------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma", "phi3"])
def test_greedy_identical_while_within_window(arch):
    m = tiny(arch)
    new = 32 - len(PROMPTS[1])  # prompt + new tokens <= window: nothing evicted
    ref = greedy_outputs(m, PROMPTS, new)
    use_(m, Sinks(window=32, num_sink_tokens=4))
    assert_same_tokens(ref, greedy_outputs(m, PROMPTS, new))
    assert routing_stats(m).infopt == len(PROMPTS)


# -- StreamingLLM beyond the window --------------------------------------------------------------------


def streaming_reference(model, prompt: list[int], new: int, window: int, sinks: int):
    """StreamingLLM from scratch: each step runs the model with no cache on the sink tokens + the newest
    tokens, at positions 0..n-1. With one layer, K/V depend on the token and position only, so a cache
    doing StreamingLLM right gives the same logits."""
    seq, logits = list(prompt), []
    with torch.no_grad():
        for i in range(new):
            ctx = seq if (len(seq) <= window or i == 0) else seq[:sinks] + seq[-(window - sinks):]
            out = model(torch.tensor([ctx]), position_ids=torch.arange(len(ctx))[None]).logits[0, -1]
            logits.append(out)
            seq.append(int(out.argmax()))
    return seq, torch.stack(logits)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma", "phi3"])
@pytest.mark.parametrize("prompt_len", [7, 20], ids=["short-prompt", "prompt-past-window"])
def test_matches_streaming_llm_from_scratch(arch, prompt_len):
    window, sinks, new = 12, 4, 24
    m = tiny(arch, num_layers=1)
    prompt = torch.randint(3, 2000, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    seq, ref_logits = streaming_reference(m, prompt[0].tolist(), new, window, sinks)
    use_(m, Sinks(window=window, num_sink_tokens=sinks))
    out = m.generate(prompt, max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert out.sequences[0].tolist() == seq
    torch.testing.assert_close(torch.cat(out.logits), ref_logits, atol=1e-4, rtol=1e-4)


def test_eager_and_sdpa_agree_beyond_window():
    # eager materializes the causal mask from the cache's mask sizes; sdpa skips it for one query
    prompt = torch.tensor([PROMPTS[0] * 3])  # 21 tokens: a prompt longer than the window, too
    outs = []
    for backend in ("sdpa", "eager"):
        m = use_(tiny("llama", attn_implementation=backend), Sinks(window=16, num_sink_tokens=4))
        outs.append(m.generate(prompt, max_new_tokens=40, do_sample=False))
    assert torch.equal(outs[0], outs[1])


def test_generation_far_beyond_window_keeps_cache_flat(monkeypatch):
    m = use_(tiny("llama"), Sinks(window=16, num_sink_tokens=4))
    made = []
    new_cache = Sinks.new_cache
    monkeypatch.setattr(Sinks, "new_cache", lambda self, model: made.append(new_cache(self, model)) or made[-1])
    out = m.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=100, do_sample=False)
    assert out.shape == (1, 107)
    (cache,) = made
    assert cache.get_seq_length() == 16 and cache.seen_tokens == 106
    assert all(layer.keys.shape[-2] == 16 for layer in cache.layers)


def test_chunked_prefill_stays_within_window(monkeypatch):
    m = use_(tiny("llama"), Sinks(window=16, num_sink_tokens=4))
    made = []
    new_cache = Sinks.new_cache
    monkeypatch.setattr(Sinks, "new_cache", lambda self, model: made.append(new_cache(self, model)) or made[-1])
    prompt = torch.randint(3, 2000, (1, 30), generator=torch.Generator().manual_seed(1))
    out = m.generate(prompt, max_new_tokens=10, do_sample=False, prefill_chunk_size=8)
    assert out.shape == (1, 40) and routing_stats(m).infopt == 1
    assert made[0].get_seq_length() == 16 and made[0].seen_tokens == 39


def test_memory_flat_in_a_hand_written_loop():
    m = use_(tiny("llama"), Sinks(window=16, num_sink_tokens=4))
    cache = Sinks(window=16, num_sink_tokens=4).new_cache(m)
    sizes = []
    with torch.no_grad():
        for t in torch.randint(3, 1000, (48,)):
            m(t.view(1, 1), past_key_values=cache)  # the hook makes room and sets in-cache positions
            sizes.append(cache.memory_bytes().allocated)
    assert len(set(sizes[15:])) == 1 and sizes[-1] == sizes[15]
    assert cache.memory_bytes().tokens == 16 and cache.seen_tokens == 48


def test_forward_without_room_made_raises():
    m = tiny("llama")  # no hook installed
    cache = Sinks(window=8, num_sink_tokens=2).new_cache(m)
    with torch.no_grad():
        m(torch.randint(3, 1000, (1, 8)), past_key_values=cache)
        with pytest.raises(RuntimeError, match="make_room"):
            m(torch.randint(3, 1000, (1, 1)), past_key_values=cache)


def test_padded_batch_and_beam_search_fall_back():
    m = use_(tiny("llama"), Sinks(window=16, num_sink_tokens=4))
    ids = torch.tensor([[2, 2, 5, 6, 7], [8, 9, 10, 11, 12]])
    m.generate(ids, attention_mask=torch.tensor([[0, 0, 1, 1, 1], [1] * 5]), max_new_tokens=3, pad_token_id=2)
    m.generate(ids[:1], max_new_tokens=3, num_beams=2)
    reasons = routing_stats(m).reasons
    assert any("padded batch" in r for r in reasons) and any("num_beams=2" in r for r in reasons)
    assert routing_stats(m).infopt == 0


def test_unpadded_batch_served():
    m = tiny("llama")
    ids = torch.tensor(PROMPTS[1:] * 2)
    ref = m.generate(ids, max_new_tokens=8, do_sample=False)
    use_(m, Sinks(window=16, num_sink_tokens=4))
    assert torch.equal(m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False), ref)
    assert routing_stats(m).infopt == 1


# -- re-rotation numerics ----------------------------------------------------------------------------


def rope_from_scratch(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """RoPE at position ``pos`` written out: channel pair (i, i + D/2) rotated by pos * theta^(-2i/D), in float64."""
    d = x.shape[-1]
    i = torch.arange(d // 2, dtype=torch.float64)
    angle = pos * theta ** (-2 * i / d)
    a, b = x[..., : d // 2].double(), x[..., d // 2:].double()
    return torch.cat((a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()), dim=-1)


@pytest.mark.parametrize("pos, delta", [(5, -3), (300, -290), (1000, 17), (7, 0)])
def test_rerotated_key_equals_key_rotated_at_new_position(pos, delta):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    m = tiny("llama")
    inv_freq, rope_type = rope_inv_freq(m)
    assert rope_type == "default"
    k = torch.randn(1, 2, 3, 16, generator=torch.Generator().manual_seed(pos))
    cos, sin = m.model.rotary_emb(k, torch.full((1, 3), pos))
    k_at_pos = apply_rotary_pos_emb(k, k, cos, sin)[1]  # as the model's attention rotates it
    moved = rerotate(k_at_pos, torch.full((3,), delta), inv_freq)
    theta = m.config.rope_parameters["rope_theta"]
    atol = 2e-5 + 1e-7 * (pos + abs(delta))  # float32 angles (the model's too) lose ~1 ulp per unit of position
    torch.testing.assert_close(moved.double(), rope_from_scratch(k, pos + delta, theta), atol=atol, rtol=1e-5)
    cos, sin = m.model.rotary_emb(k, torch.full((1, 3), pos + delta))
    torch.testing.assert_close(moved, apply_rotary_pos_emb(k, k, cos, sin)[1], atol=atol, rtol=1e-5)
    if delta == 0:
        assert torch.equal(moved, k_at_pos)  # keys that never moved come back bit-identical


def test_partial_rotary_leaves_pass_through_channels():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))  # rotary on 8 of 16 channels
    k = torch.randn(1, 1, 4, 16)
    delta = [3, -1, 0, 9]
    out = rerotate(k, torch.tensor(delta), inv_freq)
    assert torch.equal(out[..., 8:], k[..., 8:])
    for j, d in enumerate(delta):
        torch.testing.assert_close(out[..., j, :8].double(), rope_from_scratch(k[..., j, :8], d, 10000.0),
                                   atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rerotate(out, -torch.tensor(delta), inv_freq), k, atol=1e-5, rtol=1e-5)


def test_cache_positions_stay_within_window():
    m = tiny("llama")
    cache = SinkCache(m.config, window=8, num_sink_tokens=2, inv_freq=rope_inv_freq(m)[0])
    starts = []
    with torch.no_grad():
        for _ in range(5):
            starts.append(cache.make_room(3))
            m(torch.randint(3, 1000, (1, 3)), past_key_values=cache, position_ids=cache.position_ids(3))
    assert starts == [0, 3, 5, 5, 5]  # 2 sinks + 3 recent kept, the 3 new at 5..7
    assert cache.layers[0].rot_pos.tolist()[:2] == [0, 1] and cache.get_seq_length() == 8
