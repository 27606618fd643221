import pytest
import torch

import infopt
from infopt.core.errors import IncompatibleModelError, RecipeError
from infopt.core.introspect import inspect_model
from infopt.eval import assert_same_tokens, greedy_outputs, logit_metrics
from infopt.kvcache import Quantized, use_
from infopt.kvcache import quantized as quantized_mod
from infopt.kvcache.quantized import bytes_per_token
from infopt.models import tiny_model
from infopt.recipe import Recipe

from ..conftest import assert_state_equal, state_snapshot

PROMPTS = [[1, 17, 400, 23, 9, 1200, 5], [4, 4, 8, 15, 16, 23, 42, 7]]


def agreement(out: list[list[int]], ref: list[list[int]]) -> list[float]:
    """Per prompt: the share of positions where both continuations hold the same token (a missing one differs)."""
    return [sum(x == y for x, y in zip(a, b, strict=False)) / max(len(a), len(b), 1)
            for a, b in zip(out, ref, strict=True)]


def head64(arch: str = "llama", **kw):
    """A tiny model with head_dim 64 (the default model's)."""
    return tiny_model(arch, hidden_size=128, num_heads=2, num_kv_heads=1, **kw)


# -- config ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, needle", [
    ({"dtype": "fp16"}, "Quantized.dtype='fp16'"),
    ({"dtype": "fp8", "bits": 4}, "Quantized.bits=4 is invalid; allowed: 8 with dtype='fp8'"),
    ({"dtype": "fp8", "group_size": 16}, "Quantized.group_size=16 is invalid; allowed: 64 with dtype='fp8'"),
    ({"dtype": "fp8", "axis_key": "token"}, "Quantized.axis_key='token'"),
    ({"dtype": "fp8", "axis_value": "channel"}, "Quantized.axis_value='channel'"),
    ({"dtype": "fp8", "residual_length": -1}, "Quantized.residual_length=-1"),
    ({"dtype": "fp8", "residual_length": 1.5}, "Quantized.residual_length=1.5"),
    ({"dtype": "int", "residual_length": 0}, "Quantized.residual_length=0"),
], ids=["unknown-dtype", "fp8-bits4", "fp8-group", "fp8-axis-key", "fp8-axis-value", "fp8-negative-residual",
        "fp8-float-residual", "int-zero-residual"])
def test_bad_combinations_refused(fields, needle):
    with pytest.raises(RecipeError) as e:
        Quantized(**fields)
    assert needle in str(e.value)


def test_fp8_residual_need_not_be_a_multiple_of_group_size():
    assert Quantized(dtype="fp8", residual_length=0).residual_length == 0
    assert Quantized(dtype="fp8", residual_length=10).residual_length == 10


def test_default_spelling_unchanged_and_fp8_round_trip():
    assert "dtype" not in Quantized(bits=4).to_dict()["kvcache"]  # int caches: the spelling they always had
    config = Quantized(dtype="fp8", residual_length=32)
    assert config.to_dict() == {"kvcache": {"kind": "quantized", "bits": 8, "residual_length": 32, "dtype": "fp8"}}
    r = Recipe.parse({"steps": [config.to_dict()]})
    assert r.steps == (config,)
    assert Recipe.from_yaml(r.to_yaml()) == r
    assert Recipe.parse({"kvcache": {"kind": "quantized", "dtype": "int"}}).steps == (Quantized(),)


def test_refused_without_float8_dtypes(monkeypatch):
    m = head64()
    snap = state_snapshot(m)
    monkeypatch.setattr(quantized_mod, "fp8_dtype", lambda: None)
    with pytest.raises(IncompatibleModelError, match="needs torch.float8_e4m3fn.*dtype='int'"):
        infopt.optimize(m, [Quantized(dtype="fp8")])
    assert "generate" not in m.__dict__
    assert_state_equal(m, snap)


def test_fp8_works_on_any_head_dim():
    m = tiny_model("llama", hidden_size=128)  # head_dim 32: int group_size 24 is refused, fp8 has no groups
    with pytest.raises(IncompatibleModelError, match="head_dim is 32"):
        infopt.optimize(m, [Quantized(group_size=24, residual_length=48)])
    infopt.optimize(m, [Quantized(dtype="fp8")])
    assert "generate" in m.__dict__


# -- numerics --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("residual", [0, 64], ids=["all-fp8", "residual64"])
def test_logits_close_past_the_residual_window(residual):
    m = head64()
    ids = torch.randint(3, 40_000, (1, 320), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m(ids).logits[:, 256:]
        cache = Quantized(dtype="fp8", residual_length=residual).new_cache(m)
        m(ids[:, :256], past_key_values=cache)
        layer = cache.layers[0]
        assert layer.n_quant == 256 and layer.n_res == 0
        assert layer._stores["k"].view().dtype == torch.float8_e4m3fn
        assert layer._stores["k_scale"].view().shape == (1, 1, 256, 1)
        out = m(ids[:, 256:], past_key_values=cache).logits
    assert cache.get_seq_length() == 320
    assert float((out - ref).norm() / ref.norm()) < 0.02
    fig = logit_metrics(out, ref, ids[:, 256:])
    assert fig["kl"] < 1e-3 and fig["top1"] >= 0.95


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_greedy_generate_agrees_with_the_float_cache(arch):
    m = head64(arch)
    new = 40
    ref = greedy_outputs(m, PROMPTS, new)
    use_(m, Quantized(dtype="fp8", residual_length=0))  # every token stored as fp8
    agree = agreement(greedy_outputs(m, PROMPTS, new), ref)
    assert min(agree) >= 0.9, agree


def test_greedy_identical_within_residual_window():
    m = head64()
    ref = greedy_outputs(m, PROMPTS, 20)
    use_(m, Quantized(dtype="fp8", residual_length=32))
    assert_same_tokens(ref, greedy_outputs(m, PROMPTS, 20))


def test_left_padded_batch_close():
    m = head64()
    ids = torch.tensor([[2, 2, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    ref = m.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=2)
    use_(m, Quantized(dtype="fp8", residual_length=0))
    out = m.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=2)
    assert out.shape == ref.shape and float((out == ref).float().mean()) >= 0.9


# -- memory and state ------------------------------------------------------------------------------------


def test_bytes_smaller_than_fp32_and_match_the_estimate():
    m = head64(vocab_size=1024)
    config = Quantized(dtype="fp8", residual_length=0)
    cache = config.new_cache(m)
    with torch.no_grad():
        m(torch.randint(3, 1000, (1, 1000)), past_key_values=cache)
    b = cache.memory_bytes()
    per_token, dense = bytes_per_token(inspect_model(m), config)
    assert per_token == 2 * 2 * 1 * (64 + 4)  # layers * (K, V) * kv_heads * (fp8 bytes + one fp32 scale)
    assert b.tokens == 1000 and b.used == per_token * 1000
    assert b.used <= 0.27 * b.dense_fp32 and b.used < b.dense_fp16


def test_optimize_reports_fp8_and_undo():
    m = head64()
    original = m.generate
    infopt.optimize(m, [Quantized(dtype="fp8")])
    step = m.infopt.steps[0]
    assert step.key == "kvcache:quantized"
    assert step.stats["kv_ratio_vs_fp32"] == pytest.approx(68 / 256, abs=1e-4)
    assert step.notes[0].startswith("fp8 (float8_e4m3fn) KV cache")
    infopt.undo(m)
    assert "generate" not in m.__dict__ and m.generate == original


def test_crop_into_the_fp8_store():
    m = head64(num_layers=1, vocab_size=1024)
    cache = Quantized(dtype="fp8", residual_length=32).new_cache(m)
    ids = torch.randint(3, 1000, (1, 70))
    with torch.no_grad():
        m(ids, past_key_values=cache)
    layer = cache.layers[0]
    assert (layer.n_quant, layer.n_res) == (64, 6)
    cache.crop(-10)  # 6 from the residual, 4 from the store: per-token scales, so it just shortens
    assert (layer.n_quant, layer.n_res, cache.get_seq_length()) == (60, 0, 60)
    with torch.no_grad():
        out = m(ids[:, 60:64], past_key_values=cache).logits
    assert out.shape[1] == 4 and cache.get_seq_length() == 64


def test_beam_reorder_moves_fp8_rows():
    m = head64(num_layers=1, vocab_size=1024)
    cache = Quantized(dtype="fp8", residual_length=0).new_cache(m)
    with torch.no_grad():
        m(torch.randint(3, 1000, (2, 9)), past_key_values=cache)
    layer = cache.layers[0]
    k = layer._stores["k"].view().clone()
    cache.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(layer._stores["k"].view().view(torch.uint8), k.flip(0).view(torch.uint8))


# -- on each device ---------------------------------------------------------------------------------------


def test_bf16_fp8_cache_greedy_agreement(device):
    m = head64(dtype=torch.bfloat16).to(device)
    cache = Quantized(dtype="fp8", residual_length=0).new_cache(m)
    with torch.no_grad():
        m(torch.tensor([PROMPTS[0]], device=device), past_key_values=cache)
    store = cache.layers[0]._stores["k"].view()
    assert store.device.type == device and store.dtype == torch.float8_e4m3fn
    use_(m, Quantized(dtype="fp8", residual_length=0))
    for prompt in PROMPTS:
        ids = torch.tensor([prompt], device=device)
        out = m.generate(ids, max_new_tokens=40, do_sample=False)
        # step-wise agreement: at each generated position, would the bf16 model (full recompute, no
        # quantized cache) pick the same token from the same prefix? A late tie does not cascade here.
        with torch.no_grad():
            ref_next = m(out).logits[0, len(prompt) - 1 : -1].argmax(-1)
        agree = float((ref_next == out[0, len(prompt):]).float().mean())
        assert agree >= 0.9, agree
