"""Speculative sampling keeps the target's distribution (chi-square, fixed seeds); a broken rule is detected."""

import pytest
import torch

from infopt.generate import routing_stats
from infopt.models import tiny_model
from infopt.speculative import DraftModel, PromptLookup, Warp, enable_, stats, verify_sample

# chi-square critical value at p = 0.001 for 7 degrees of freedom (8 categories)
CHI2_CRIT_7DF = 24.32


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a sample fell where the target has zero probability"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def first_tokens(p, q, n, seed, k=3, lie_about_q=False):
    """Sample ``n`` rounds of the rule with drafts from ``q``; return counts of each emitted position-0 token
    and of the second emitted token when the first draft was accepted."""
    g = torch.Generator().manual_seed(seed)
    V = p.shape[-1]
    draft = torch.multinomial(q.expand(n, V), k, replacement=True, generator=g)  # [n, k], iid from q
    P = p.expand(n, k + 1, V).contiguous()
    Q = q.expand(n, k, V).contiguous()
    told = torch.full_like(Q, 1.0 / V) if lie_about_q else Q
    accepted, nxt = verify_sample(P, told, draft, torch.full((n,), k), generator=g)
    first = torch.where(accepted > 0, draft[:, 0], nxt)
    return torch.bincount(first, minlength=V).double()


@pytest.fixture
def pq():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(8, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(8, generator=g) * 1.5, -1)
    return p, q


def test_rule_keeps_target_distribution(pq):
    p, q = pq
    counts = first_tokens(p, q, 40_000, seed=1)
    assert chi2(counts, p) < CHI2_CRIT_7DF


def test_rule_with_point_mass_drafts(pq):
    p, _ = pq
    q = torch.zeros(8)
    q[3] = 1.0  # prompt lookup: always drafts token 3
    n = 40_000
    g = torch.Generator().manual_seed(2)
    draft = torch.full((n, 2), 3)
    accepted, nxt = verify_sample(p.expand(n, 3, 8).contiguous(), None, draft, torch.full((n,), 2), generator=g)
    first = torch.where(accepted > 0, draft[:, 0], nxt)
    assert chi2(torch.bincount(first, minlength=8).double(), p) < CHI2_CRIT_7DF


def test_broken_rule_is_detected(pq):
    """Telling the rule a wrong draft distribution (uniform instead of the q the drafts came from) breaks it."""
    p, q = pq
    counts = first_tokens(p, q, 40_000, seed=1, lie_about_q=True)
    assert chi2(counts, p) > 10 * CHI2_CRIT_7DF


def test_warp_matches_transformers_processors():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    ref = TopPLogitsWarper(0.8)(None, TopKLogitsWarper(20)(None, TemperatureLogitsWarper(0.7)(None, scores.clone())))
    assert torch.equal(Warp(temperature=0.7, top_k=20, top_p=0.8).filter(scores), ref)


def _marginal_second_token(model, prompt, warp):
    """Exact distribution of the second generated token: sum over first tokens x of p(x) p(. | x)."""
    with torch.no_grad():
        p1 = warp.filter(model(prompt).logits[0, -1].float()).softmax(-1)
        V = p1.shape[0]
        ext = torch.cat([prompt.expand(V, -1), torch.arange(V)[:, None]], 1)
        p2 = warp.filter(model(ext).logits[:, -1].float()).softmax(-1)  # [V, V]
    return p1, p1 @ p2


@pytest.mark.parametrize("drafter", ["draft-model", "lookup"])
def test_generate_sampling_matches_target(drafter):
    """End to end on a 8-token vocabulary: a batch of identical prompts sampled speculatively (per-row accept
    lengths differ), first and second tokens chi-square tested against the target's exact distribution. The
    second token comes from the first speculative round (a drafted token accepted, or the residual sample)."""
    target = tiny_model(vocab_size=8, seed=0)
    cfg = (DraftModel(tiny_model(vocab_size=8, seed=5, num_layers=1), num_tokens=3) if drafter == "draft-model"
           else PromptLookup(num_tokens=3, ngram=(1, 1)))
    prompt = torch.tensor([[1, 2, 3, 1, 2]])
    warp = Warp(temperature=1.3, top_k=None)
    p1, p2 = _marginal_second_token(target, prompt, warp)
    enable_(target, cfg)
    torch.manual_seed(0)
    n = 6000
    out = target.generate(prompt.expand(n, -1), max_new_tokens=3, do_sample=True, temperature=1.3, top_k=0,
                          eos_token_id=None, pad_token_id=0)  # no EOS: every row samples both tokens
    assert routing_stats(target).infopt == 1 and stats(target)["drafted"] > 0
    first, second = out[:, 5], out[:, 6]
    assert chi2(torch.bincount(first, minlength=8).double(), p1) < CHI2_CRIT_7DF
    assert chi2(torch.bincount(second, minlength=8).double(), p2) < CHI2_CRIT_7DF
