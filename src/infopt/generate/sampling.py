"""Next-token choice for every decode loop: the one logits filter, the per-request generator, the batched pick.

:func:`filter_logits` is temperature, then top-k, then top-p on ``[..., V]`` fp32 logits: the order and the
arithmetic of transformers' logits warpers (``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``),
bit for bit (tested), so the speculative loop and the batching engine sample from exactly the distribution the lean
loop's warpers give, which transformers builds itself. The speculative loop filters its ``[B, k + 1, V]`` verify
scores with it; the engine picks one token per sequence with :func:`choose_tokens`, each sampled request drawing
from its own :func:`make_generator`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = ["filter_logits", "make_generator", "choose_tokens", "Sampling"]


class Sampling(Protocol):
    """What :func:`choose_tokens` reads of a request's settings (``infopt.batching.SamplingParams`` has it)."""

    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float


def filter_logits(scores: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float = 1.0) -> torch.Tensor:
    """Temperature, then top-k, then top-p on fp32 ``scores`` ``[..., V]`` (a new tensor; removed tokens at -inf).

    Args:
        scores: logits over the vocabulary in the last dimension.
        temperature: divides the logits (1.0: unchanged).
        top_k: keep the ``top_k`` largest logits, ties at the k-th included (0 or None: all).
        top_p: keep the smallest set of tokens whose probability reaches ``top_p``, and always the most likely one
            (1.0: all).

    Returns:
        The filtered logits, the same shape.

    Example:
        >>> filter_logits(torch.tensor([[1.0, 2.0, 3.0]]), top_k=2)
        tensor([[-inf, 2., 3.]])
        >>> filter_logits(torch.tensor([3.0, 2.0, 1.0, 0.0]), top_p=0.5).isinf().tolist()
        [False, True, True, True]
    """
    if temperature != 1.0:
        scores = scores / temperature
    if top_k:
        kth = torch.topk(scores, min(int(top_k), scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if top_p < 1.0:
        ascending, order = torch.sort(scores, dim=-1, descending=False)
        drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p  # the low tail whose mass stays within 1 - p
        drop[..., -1:] = False  # always keep the most likely token
        scores = scores.masked_fill(drop.scatter(-1, order, drop), -float("inf"))
    return scores


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


def choose_tokens(logits: torch.Tensor, params: Sequence[Sampling], generators: Sequence[torch.Generator | None],
                  eos_masks: Sequence[Sequence[int] | None]) -> list[int]:
    """One next token per row of ``logits`` ``[S, V]``, computed on the logits' device with one sync for all rows.

    Args:
        logits: each sequence's next-token logits (any float dtype; sampled rows are filtered in fp32 like
            ``generate``; greedy rows take the first maximum, which widening to fp32 would not change).
        params: each row's settings (``do_sample``, ``temperature``, ``top_k``, ``top_p``: an
            ``infopt.batching.SamplingParams``).
        generators: each sampled row's ``torch.Generator`` (None for greedy rows), on the logits' device
            (:func:`make_generator`); one on another device draws there and its noise is copied over.
        eos_masks: per row, end-of-sequence ids to forbid this step (``min_new_tokens`` not reached), or None.

    Returns:
        The chosen token ids, one per row.

    Example:
        >>> from infopt.batching import SamplingParams
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
            p = params[i]
            x = filter_logits(scores[i].to(torch.float32), p.temperature, p.top_k, p.top_p)
            # Gumbel-max: argmax(x - log E), E ~ Exp(1), draws token i with probability softmax(x)_i. It stays in
            # logit space (tiny probabilities would be denormal floats, which are slow on CPUs) and, unlike
            # torch.multinomial, takes one pass over the vocabulary
            g = generators[i]
            dev = g.device if g is not None else x.device
            race = torch.empty(x.shape, dtype=x.dtype, device=dev).exponential_(1.0, generator=g).to(x.device)
            races.append(x - race.log())
        tokens[torch.tensor(sampled, device=tokens.device)] = torch.stack(races).argmax(-1)
    return tokens.tolist()  # the one device -> host copy of the step
