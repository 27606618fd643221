"""Greedy speculative decoding is token-identical to plain generate, for every drafter, batch size and edge case."""

import pytest
import torch

import infopt
from infopt.generate import routing_stats
from infopt.models import tiny_model
from infopt.speculative import DraftModel, PromptLookup, SelfDraft, enable_, stats


def prompts(n=20, seed=0, vocab=400):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        base = torch.randint(3, vocab, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g)
        out.append(torch.cat([base, base[: 1 + i % 4]])[None])  # a repeat, so lookups find matches
    return out


def draft_for(kind):
    if kind == "lookup":
        return PromptLookup(num_tokens=4)
    if kind == "lookup-adaptive":
        return PromptLookup(num_tokens="adaptive")
    if kind == "draft-model":
        return DraftModel(tiny_model(num_layers=1, seed=1), num_tokens=3)
    if kind == "self-int8":
        return SelfDraft(quantize="int8", num_tokens=3)
    if kind == "self-layers":
        return SelfDraft(quantize=None, num_layers=1, num_tokens="adaptive")
    raise ValueError(kind)


KINDS = ["lookup", "lookup-adaptive", "draft-model", "self-int8", "self-layers"]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_identical_20_prompts(kind):
    ref, m = tiny_model(), tiny_model()
    enable_(m, draft_for(kind))
    for p in prompts():
        want = ref.generate(p, max_new_tokens=24, do_sample=False)
        got = m.generate(p, max_new_tokens=24, do_sample=False)
        assert torch.equal(got, want), (p, got, want)
    assert routing_stats(m).infopt == 20 and routing_stats(m).original == 0
    s = stats(m)
    assert s["tokens"] == 20 * 24 and 0 < s["target_forwards_per_token"] <= 1


@pytest.mark.parametrize("kind, device", [("lookup", "cpu"), ("draft-model", "cpu"), ("self-int8", "cpu"),
                                          pytest.param("lookup", "cuda", marks=pytest.mark.gpu)])
def test_greedy_batch_left_padding(kind, device):
    ref, m = tiny_model().to(device), tiny_model().to(device)
    enable_(m, draft_for(kind))
    ps = prompts(4, seed=3)
    T = max(p.shape[1] for p in ps)
    ids = torch.zeros(4, T, dtype=torch.long)
    mask = torch.zeros(4, T, dtype=torch.long)
    for i, p in enumerate(ps):
        ids[i, T - p.shape[1]:] = p[0]
        mask[i, T - p.shape[1]:] = 1
    ids, mask = ids.to(device), mask.to(device)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    got = m.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


def test_batch_rows_accept_different_lengths():
    """A batch where one row copies its prompt and another does not: per-row accept lengths leave holes."""
    ref, m = tiny_model(), tiny_model()
    enable_(m, PromptLookup(num_tokens=4))
    a = ref.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=30, do_sample=False)[0, 4:]
    ids = torch.stack([torch.cat([torch.tensor([5, 6, 7, 8]), a[:20], torch.tensor([5, 6, 7, 8])]),
                       torch.randint(3, 400, (28,), generator=torch.Generator().manual_seed(1))])
    want = ref.generate(ids, max_new_tokens=24, do_sample=False)
    got = m.generate(ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(got, want)
    assert stats(m)["accepted"] > 0


@pytest.mark.parametrize("kind", ["lookup", "self-int8"])
@pytest.mark.parametrize("new", [1, 2, 5])
def test_short_outputs(kind, new):
    ref, m = tiny_model(), tiny_model()
    enable_(m, draft_for(kind))
    p = prompts(1)[0]
    assert torch.equal(m.generate(p, max_new_tokens=new, do_sample=False),
                       ref.generate(p, max_new_tokens=new, do_sample=False))


@pytest.mark.parametrize("kind", ["lookup", "draft-model"])
def test_eos_and_min_new_tokens(kind):
    ref, m = tiny_model(), tiny_model()
    enable_(m, draft_for(kind))
    for p in prompts(6, seed=5):
        plain = ref.generate(p, max_new_tokens=16, do_sample=False)
        eos = int(plain[0, p.shape[1] + 5])  # a token the model emits: stops there
        for kw in ({}, {"min_new_tokens": 9}):
            want = ref.generate(p, max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=0, **kw)
            got = m.generate(p, max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=0, **kw)
            assert torch.equal(got, want), kw


def test_batch_eos_pads_finished_rows():
    ref, m = tiny_model(), tiny_model()
    enable_(m, PromptLookup(num_tokens=3))
    ids = torch.cat([prompts(1, seed=7)[0][:, :6], prompts(1, seed=8)[0][:, :6]])
    plain = ref.generate(ids, max_new_tokens=12, do_sample=False)
    eos = int(plain[0, 6 + 3])
    want = ref.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=0)
    got = m.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ["qwen2", "gemma", "gpt2"])
def test_other_architectures(arch):
    ref, m = tiny_model(arch), tiny_model(arch)
    enable_(m, PromptLookup(num_tokens=4))
    for p in prompts(4):
        assert torch.equal(m.generate(p, max_new_tokens=12, do_sample=False),
                           ref.generate(p, max_new_tokens=12, do_sample=False))


def _windowed(arch):
    m = tiny_model(arch)
    if arch == "mistral":
        m.config.sliding_window = 24  # Mistral's window comes from its config (tiny_model builds it without one)
    return m


@pytest.mark.parametrize("kvcache", [None, "static"])
@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_sliding_window_models_past_the_window(arch, kvcache):
    """Sliding-window layers (gemma3: 64, mistral here: 24) keep every token on a cache that rolls back; the mask
    applies the window, so batch-1 calls past it stay plain generate's; a batch that may run past the window goes
    to plain generate (a row's rejected slots would count towards its window)."""
    from infopt.kvcache import Static

    ref, m = _windowed(arch), _windowed(arch)
    infopt.optimize(m, ([Static(max_length=256)] if kvcache else []) + [SelfDraft(quantize="int8", num_tokens=3)])
    long = torch.randint(3, 400, (1, 80), generator=torch.Generator().manual_seed(0))
    for p in (*prompts(3), long):
        assert torch.equal(m.generate(p, max_new_tokens=20, do_sample=False),
                           ref.generate(p, max_new_tokens=20, do_sample=False))
    assert routing_stats(m).loops == {"speculative": 4}
    batch = torch.cat([long, long.flip(1)])
    assert torch.equal(m.generate(batch, max_new_tokens=8, do_sample=False),
                       ref.generate(batch, max_new_tokens=8, do_sample=False))
    # not speculative: to plain generate (with the reason), or transformers' loop on the static cache
    stats = routing_stats(m)
    assert stats.loops["speculative"] == 4
    assert any("sliding-window" in r for r in stats.reasons) if not kvcache else stats.loops["transformers+cache"] == 1


def test_static_cache_composes():
    from infopt.kvcache import Static

    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=256), SelfDraft(quantize="int8", num_tokens=3)])
    for p in prompts(5):
        assert torch.equal(m.generate(p, max_new_tokens=20, do_sample=False),
                           ref.generate(p, max_new_tokens=20, do_sample=False))
    assert routing_stats(m).infopt == 5
    assert "static cache" in " ".join(m.infopt.steps[-1].notes)


def test_quantized_target_composes():
    from infopt.quantize import Int8WeightOnly

    ref, m = tiny_model(), tiny_model()
    infopt.optimize(ref, [Int8WeightOnly()])
    infopt.optimize(m, [Int8WeightOnly(), PromptLookup(num_tokens=4)])
    for p in prompts(4):
        assert torch.equal(m.generate(p, max_new_tokens=12, do_sample=False),
                           ref.generate(p, max_new_tokens=12, do_sample=False))


@pytest.mark.parametrize("kind", ["lookup", "self"])
def test_int32_input_ids(kind):
    """Plain generate takes int32 ids (and returns int64); the speculative loop did not (scatter dtype clash)."""
    ref, m = tiny_model(), tiny_model()
    enable_(m, PromptLookup() if kind == "lookup" else SelfDraft(num_layers=1))
    p = torch.tensor([[1, 17, 400, 23, 9, 1200, 5, 17, 400, 23]], dtype=torch.int32)
    kw = dict(max_new_tokens=10, do_sample=False)
    out, want = m.generate(p, **kw), ref.generate(p, **kw)
    assert out.dtype == want.dtype == torch.int64 and torch.equal(out, want)
    assert routing_stats(m).infopt == 1
