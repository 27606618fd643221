"""Next-token choice for a step's sequences: fp32 greedy argmax, or seeded temperature / top-k / top-p sampling."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .params import SamplingParams

__all__ = ["filter_logits", "choose_tokens"]


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the order ``generate``'s warpers use) on one row ``[V]`` of fp32 logits.

    Returns:
        Logits with the removed tokens at ``-inf``.

    Example:
        >>> x = torch.tensor([3.0, 2.0, 1.0, 0.0])
        >>> filter_logits(x, SamplingParams(temperature=1.0, top_k=2)).isinf().tolist()
        [False, False, True, True]
    """
    x = logits / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, -float("inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=False)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop = cum <= 1 - params.top_p  # the low tail whose mass stays within 1 - top_p
        drop[-1] = False  # always keep the most likely token
        x = x.masked_fill(drop.scatter(0, order, drop), -float("inf"))
    return x


def choose_tokens(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                  eos_masks: Sequence[torch.Tensor | None]) -> list[int]:
    """One next token per row of ``logits`` ``[S, V]``.

    Args:
        logits: each sequence's next-token logits (any float dtype; computed in fp32 like ``generate``).
        params: each row's :class:`SamplingParams`.
        generators: each sampled row's ``torch.Generator`` (None for greedy rows).
        eos_masks: per row, end-of-sequence ids to forbid this step (``min_new_tokens`` not reached), or None.

    Returns:
        The chosen token ids, one per row.
    """
    scores = logits.to(torch.float32)
    for i, eos in enumerate(eos_masks):
        if eos is not None:
            scores[i, eos] = -float("inf")
    greedy = scores.argmax(-1).tolist()  # [S]: one batched argmax serves every greedy row
    out = []
    for i, p in enumerate(params):
        if not p.do_sample:
            out.append(int(greedy[i]))
            continue
        x = filter_logits(scores[i], p)
        # Gumbel-max: argmax(x - log E), E ~ Exp(1), draws token i with probability softmax(x)_i. It stays in
        # logit space (tiny probabilities would be denormal floats, which are slow on CPUs) and, unlike
        # torch.multinomial, takes one pass over the vocabulary
        race = torch.empty_like(x).exponential_(1.0, generator=generators[i])
        out.append(int((x - race.log()).argmax().item()))
    return out
