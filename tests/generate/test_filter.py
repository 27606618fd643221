"""infopt.generate.sampling: the one logits filter the speculative loop and the engine sample through is
transformers' warpers, bit for bit."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from infopt.batching import SamplingParams
from infopt.generate.sampling import choose_tokens, filter_logits, make_generator
from infopt.speculative import Warp


def _warpers(scores: torch.Tensor, temperature: float, top_k: int | None, top_p: float) -> torch.Tensor:
    """What generate's sampling applies, with transformers' own warpers on ``[B, V]`` (added only when set, as
    generate does)."""
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores


SETTINGS = list(itertools.product([1.0, 0.7, 1.3], [None, 1, 20, 50, 4000], [1.0, 0.9, 0.5, 0.01]))


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_filter_is_transformers_warpers_bit_for_bit(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(hash((temperature, top_k, top_p)) % 2**31)
    scores = torch.randn(4, 3000, generator=g) * 3
    scores[1, :10] = scores[1, 10]  # ties at the k-th logit: kept, as TopKLogitsWarper keeps them
    ref = _warpers(scores.clone(), temperature, top_k, top_p)
    assert torch.equal(filter_logits(scores, temperature, top_k, top_p), ref)
    # any leading shape: one row alone, and the speculative loop's [B, k + 1, V]
    assert torch.equal(filter_logits(scores[2], temperature, top_k, top_p), ref[2])
    assert torch.equal(filter_logits(scores.view(2, 2, -1), temperature, top_k, top_p), ref.view(2, 2, -1))
    assert torch.equal(Warp(temperature, top_k, top_p).filter(scores), ref)
    assert bool((~ref.isinf()).any(-1).all())  # every row keeps at least its most likely token


def test_the_engine_samples_from_the_filtered_distribution():
    """choose_tokens' Gumbel-max race draws from softmax(filter_logits(...)): the counts of 20,000 seeded draws
    over a 6-token vocabulary match those probabilities (chi-square, 5 degrees of freedom, p = 0.001)."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -3.0]])
    hot = SamplingParams(temperature=0.8, top_k=5, top_p=0.95)
    p = filter_logits(logits[0], 0.8, 5, 0.95).softmax(-1)
    g = make_generator("cpu", 3)
    counts = torch.bincount(torch.tensor([choose_tokens(logits, [hot], [g], [None])[0] for _ in range(20_000)]),
                            minlength=6).double()
    assert counts[p == 0].sum() == 0  # filtered tokens are never drawn
    expected = p.double() * counts.sum()
    kept = expected > 0
    chi2 = float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())
    assert chi2 < 20.5, (counts.tolist(), expected.tolist())  # chi-square 0.999 quantile, 5 dof: 20.52
