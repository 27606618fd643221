"""Next-token choice for a step's sequences: fp32 greedy argmax, or seeded temperature / top-k / top-p sampling."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .params import SamplingParams

__all__ = ["filter_logits", "choose_tokens", "make_generator"]


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


def make_generator(device: torch.device | str, seed: int) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed``, for one request's sampling.

    The generator must live where the logits are: CUDA kernels cannot draw from a CPU generator. The same seed
    draws the same tokens on the same device; a CPU and a CUDA generator with one seed give different streams.

    Args:
        device: the model's device (``engine.device``).
        seed: the request's seed.

    Returns:
        The seeded generator.

    Raises:
        RuntimeError: from torch, for a device type without generators (``meta``).

    Example:
        >>> make_generator("cpu", 7).device
        device(type='cpu')
    """
    return torch.Generator(device=torch.device(device)).manual_seed(int(seed))


def choose_tokens(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                  eos_masks: Sequence[Sequence[int] | None]) -> list[int]:
    """One next token per row of ``logits`` ``[S, V]``, computed on the logits' device with one sync for all rows.

    Args:
        logits: each sequence's next-token logits (any float dtype; sampled rows are filtered in fp32 like
            ``generate``; greedy rows take the first maximum, which widening to fp32 would not change).
        params: each row's :class:`SamplingParams`.
        generators: each sampled row's ``torch.Generator`` (None for greedy rows), on the logits' device
            (:func:`make_generator`); one on another device draws there and its noise is copied over.
        eos_masks: per row, end-of-sequence ids to forbid this step (``min_new_tokens`` not reached), or None.

    Returns:
        The chosen token ids, one per row.

    Example:
        >>> x = torch.tensor([[0.0, 5.0, 1.0], [9.0, 0.0, 0.0]])
        >>> choose_tokens(x, [SamplingParams(), SamplingParams()], [None, None], [None, [0]])
        [1, 1]
    """
    scores = logits
    masked = [(i, t) for i, eos in enumerate(eos_masks) if eos is not None for t in eos]
    if masked:  # one index_put for every masked (row, id) pair, on a copy: the caller's logits stay as they were
        rows, cols = torch.tensor(masked, dtype=torch.long, device=scores.device).unbind(1)
        scores = scores.clone()
        scores[rows, cols] = -float("inf")
    # [S]: one batched max serves every greedy row. In the logits' own dtype: widening bf16/fp16 to fp32 is exact,
    # so the first maximum is the same token generate's fp32 argmax picks, and max(dim) runs about 2.5x faster
    # than argmax on CPU
    tokens = scores.max(-1).indices
    sampled = [i for i, p in enumerate(params) if p.do_sample]
    if sampled:
        races = []
        for i in sampled:
            x = filter_logits(scores[i].to(torch.float32), params[i])
            # Gumbel-max: argmax(x - log E), E ~ Exp(1), draws token i with probability softmax(x)_i. It stays in
            # logit space (tiny probabilities would be denormal floats, which are slow on CPUs) and, unlike
            # torch.multinomial, takes one pass over the vocabulary
            g = generators[i]
            dev = g.device if g is not None else x.device
            race = torch.empty(x.shape, dtype=x.dtype, device=dev).exponential_(1.0, generator=g).to(x.device)
            races.append(x - race.log())
        tokens[torch.tensor(sampled, device=tokens.device)] = torch.stack(races).argmax(-1)
    return tokens.tolist()  # the one device -> host copy of the step
