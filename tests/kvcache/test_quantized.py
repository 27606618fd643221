import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import infopt
from infopt.core.errors import IncompatibleModelError, RecipeError
from infopt.core.introspect import inspect_model
from infopt.eval import assert_same_tokens, greedy_outputs
from infopt.generate import routing_stats
from infopt.kvcache import Quantized, use_
from infopt.kvcache.quantized import bytes_per_token, dequantize_groups, pack_int4, quantize_groups, unpack_int4
from infopt.models import tiny_model
from infopt.recipe import Recipe

from ..conftest import assert_state_equal, state_snapshot

PROMPTS = [[1, 17, 400, 23, 9, 1200, 5], [4, 4, 8, 15, 16, 23, 42, 7]]


def head64(arch: str = "llama", **kw):
    """A tiny model with head_dim 64 (the default model's), so group_size 64 fits."""
    return tiny_model(arch, hidden_size=128, num_heads=2, num_kv_heads=1, **kw)


# -- config validation -------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("bits", 3), ("bits", 16), ("bits", True), ("bits", "8"),
    ("group_size", 0), ("group_size", -64), ("group_size", 1.5),
    ("residual_length", 0), ("residual_length", 100), ("residual_length", 32),
    ("axis_key", "row"), ("axis_value", "head"),
], ids=lambda v: str(v))
def test_bad_fields_refused(field, value):
    with pytest.raises(RecipeError, match=f"Quantized.{field}="):
        Quantized(**{field: value})


def test_group_size_must_divide_head_dim_model_untouched():
    m = tiny_model("llama", hidden_size=128)  # head_dim 32
    snap = state_snapshot(m)
    with pytest.raises(IncompatibleModelError, match="head_dim is 32"):
        infopt.optimize(m, [Quantized(group_size=24, residual_length=48)])
    assert "generate" not in m.__dict__
    assert_state_equal(m, snap)
    # keys per channel and values per channel group along tokens only: any head_dim works
    infopt.optimize(m, [Quantized(group_size=24, residual_length=48, axis_value="channel")])
    assert "generate" in m.__dict__


def test_group_wider_than_head_dim_is_one_group_per_head():
    """head_dim 16 under the default group_size 64: each token's head is one value group (the values stored are
    those group_size=16 stores), keys keep their 64-token groups, and the step applies."""
    m = tiny_model("llama")  # head_dim 16
    ids = torch.randint(3, 1000, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        wide, narrow = Quantized(bits=4).new_cache(m), Quantized(bits=4, group_size=16, residual_length=128).new_cache(m)
        m(ids, past_key_values=wide)
        m(ids, past_key_values=narrow)
    w, n = wide.layers[0]._stores, narrow.layers[0]._stores
    assert wide.layers[0].n_quant == 128
    assert all(torch.equal(w[k].view(), n[k].view()) for k in ("v", "v_scale", "v_zero"))
    assert w["k_scale"].view().shape[-2] == 128 // 64  # a key channel's group: 64 tokens
    per_token, dense = bytes_per_token(inspect_model(m), Quantized(bits=4))
    assert wide.memory_bytes().used == pytest.approx(per_token * 128 + dense * 72, rel=1e-6)  # 72 tokens exact
    infopt.optimize(m, [Quantized()])
    assert m.generate(ids[:, :7], max_new_tokens=4, do_sample=False).shape == (1, 11)


def test_sliding_window_model_served_with_the_window_applied():
    """gemma3 (sliding window 64): every layer keeps all tokens and the model's mask applies the window, so greedy
    output is plain generate's while prompt + new tokens stay in the residual window, past the sliding window too."""
    ref, m = tiny_model("gemma3"), tiny_model("gemma3")
    use_(m, Quantized(group_size=16, residual_length=128))
    ids = torch.randint(3, 1000, (1, 90), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=30, do_sample=False)
    assert torch.equal(m.generate(ids, **kw), ref.generate(ids, **kw))
    assert routing_stats(m).infopt == 1


@pytest.mark.parametrize("spelling", [
    {"kvcache": {"kind": "quantized", "bits": 4}},
    {"steps": [{"kvcache": {"kind": "quantized", "bits": 4}}]},
])
def test_recipe_spelling_round_trip(spelling):
    r = Recipe.parse(spelling)
    assert r.steps == (Quantized(bits=4),)
    assert Recipe.parse(r.to_dict()) == r
    assert Recipe.from_yaml(r.to_yaml()) == r
    assert r.steps[0].to_dict() == {"kvcache": {"kind": "quantized", "bits": 4, "group_size": 64,
                                                "residual_length": 128, "axis_key": "channel",
                                                "axis_value": "token"}}


# -- installation ------------------------------------------------------------------------------------


def test_optimize_reports_bytes_and_undo_restores_generate():
    m = head64()
    original = m.generate
    ref = greedy_outputs(m, PROMPTS, 6)
    infopt.optimize(m, [Quantized(bits=8)])
    assert "generate" in m.__dict__
    step = m.infopt.steps[0]
    assert step.key == "kvcache:quantized"
    assert step.stats["kv_ratio_vs_fp32"] < 0.3
    assert any(k.startswith("kv_bytes_saved_at_") and v > 0 for k, v in step.stats.items())
    assert "MiB saved" in step.notes[0]
    assert_same_tokens(ref, greedy_outputs(m, PROMPTS, 6))
    infopt.undo(m)
    assert "generate" not in m.__dict__ and m.generate == original
    assert_same_tokens(ref, greedy_outputs(m, PROMPTS, 6))


def test_use_dispatches_on_config_type():
    from infopt.attention import Attention

    with pytest.raises(RecipeError, match="kvcache config"):
        use_(head64(), Attention("eager"))


@pytest.mark.parametrize("arch, bits", [("llama", 8), ("qwen2", 4), ("gemma", 8), ("gpt2", 4)],
                         ids=["llama-int8", "qwen2-int4", "gemma-int8", "gpt2-int4"])
def test_greedy_identical_within_residual_window(arch, bits):
    m = head64(arch)
    config = Quantized(bits=bits, group_size=16, residual_length=32)
    new = 32 - len(PROMPTS[1])  # prompt + new <= residual_length: nothing is ever quantized
    ref = greedy_outputs(m, PROMPTS, new)
    use_(m, config)
    assert_same_tokens(ref, greedy_outputs(m, PROMPTS, new))
    assert routing_stats(m).infopt == len(PROMPTS)


def test_left_padded_batch_served():
    m = head64()
    ids = torch.tensor([[2, 2, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    ref = m.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=2)
    use_(m, Quantized(group_size=16, residual_length=32))
    out = m.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=2)
    assert torch.equal(out, ref)
    assert routing_stats(m).infopt == 1


def test_beam_search_falls_back(prompt):
    m = head64()
    ref = m.generate(prompt, max_new_tokens=3, num_beams=2, do_sample=False)
    use_(m, Quantized())
    assert torch.equal(m.generate(prompt, max_new_tokens=3, num_beams=2, do_sample=False), ref)
    stats = routing_stats(m)
    assert stats.original == 1 and any("num_beams=2" in r for r in stats.reasons)


# -- numerics ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits, bound", [(8, 0.005), (4, 0.05)], ids=["int8", "int4"])
@pytest.mark.parametrize("axes", [("channel", "token"), ("token", "channel")], ids=["kivi", "swapped"])
def test_logits_close_past_the_residual_window(bits, bound, axes):
    m = head64()
    ids = torch.randint(3, 40_000, (1, 320), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m(ids).logits[:, 256:]
        cache = Quantized(bits=bits, group_size=32, residual_length=64, axis_key=axes[0],
                          axis_value=axes[1]).new_cache(m)
        m(ids[:, :256], past_key_values=cache)
        assert cache.layers[0].n_quant == 256 and cache.layers[0].n_res == 0
        out = m(ids[:, 256:], past_key_values=cache).logits
    assert float((out - ref).norm() / ref.norm()) < bound
    assert cache.get_seq_length() == 320


@settings(max_examples=60, deadline=None)
@given(lead=st.lists(st.integers(1, 3), min_size=0, max_size=3), half=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_int4_pack_unpack_round_trip(lead, half, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (*lead, 2 * half), generator=g, dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (*lead, half)
    assert torch.equal(unpack_int4(packed), q)


@settings(max_examples=80, deadline=None)
@given(bits=st.sampled_from([8, 4]), axis=st.sampled_from(["channel", "token"]), group=st.sampled_from([2, 4, 8, 16]),
       groups=st.integers(1, 4), other=st.sampled_from([2, 4, 6, 16]), heads=st.integers(1, 3),
       spread=st.floats(1e-3, 1e3), offset=st.floats(-100, 100), seed=st.integers(0, 2**16))
def test_quantize_error_at_most_half_a_step(bits, axis, group, groups, other, heads, spread, offset, seed):
    # [B, H, T, D]: the grouped axis has `groups` groups; the other axis any (even, for int4 packing) size
    t, d = (group * groups, other) if axis == "channel" else (other, group * groups)
    x = torch.randn(1, heads, t, d, generator=torch.Generator().manual_seed(seed)) * spread + offset
    codes, scale, zero = quantize_groups(x, bits, group, axis)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == (d // 2 if bits == 4 else d)
    y = dequantize_groups(codes, scale, zero, bits, group, axis)
    step = scale.repeat_interleave(group, dim=-2 if axis == "channel" else -1)  # per element
    assert y.shape == x.shape
    assert bool(((y - x).abs() <= step / 2 + 1e-6 * (x.abs() + 1)).all())


def test_constant_group_is_exact():
    x = torch.full((1, 1, 4, 8), 3.25)
    codes, scale, zero = quantize_groups(x, 4, 4, "channel")
    assert torch.equal(dequantize_groups(codes, scale, zero, 4, 4, "channel"), x)


# -- memory ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits, limit", [(8, 0.3), (4, 0.17)], ids=["int8", "int4"])
def test_bytes_against_fp32_at_long_length(bits, limit):
    m = head64(vocab_size=1024)
    config = Quantized(bits=bits, group_size=64, residual_length=128)
    cache = config.new_cache(m)
    with torch.no_grad():
        m(torch.randint(3, 1000, (1, 4096 + 5)), past_key_values=cache)
    b = cache.memory_bytes()
    assert b.tokens == 4101
    assert b.dense_fp32 == 2 * 2 * 1 * 64 * 4 * 4101  # layers * (K, V) * kv_heads * head_dim * 4 bytes * tokens
    assert b.used <= limit * b.dense_fp32
    assert b.used <= b.allocated and b.saved > 0
    per_token, dense = bytes_per_token(inspect_model(m), config)
    assert b.used == pytest.approx(per_token * 4096 + dense * 5, rel=1e-6)  # 5 residual tokens stay exact
    # the residual buffer (128 tokens) is allocated in full
    assert b.allocated - b.used >= (128 - 5) * dense


def test_store_grows_geometrically():
    m = head64(num_layers=1, vocab_size=1024)
    cache = Quantized(bits=8, group_size=8, residual_length=8).new_cache(m)
    capacities = []
    with torch.no_grad():
        for _ in range(24):
            m(torch.randint(3, 1000, (1, 8)), past_key_values=cache)
            capacities.append(cache.layers[0]._stores["k"].buf.shape[2])
    assert sorted(set(capacities)) == [8, 16, 32, 64, 128, 256]  # doubling: O(log n) reallocations
    assert cache.get_seq_length() == 192


def test_crop_into_quantized_part():
    m = head64(num_layers=1, vocab_size=1024)
    cache = Quantized(bits=8, group_size=16, residual_length=32).new_cache(m)
    ids = torch.randint(3, 1000, (1, 70))
    with torch.no_grad():
        m(ids, past_key_values=cache)
    layer = cache.layers[0]
    assert (layer.n_quant, layer.n_res) == (64, 6)
    cache.crop(-4)
    assert (layer.n_quant, layer.n_res) == (64, 2)
    cache.crop(-10)  # 2 from the residual, 8 from the last quantized chunk, which comes back dequantized
    assert (layer.n_quant, layer.n_res, cache.get_seq_length()) == (32, 24, 56)
    with torch.no_grad():  # and the cache keeps working
        out = m(ids[:, 56:60], past_key_values=cache).logits
    assert out.shape[1] == 4 and cache.get_seq_length() == 60
    with pytest.raises(ValueError, match="negative"):
        cache.crop(3)
