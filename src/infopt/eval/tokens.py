"""Exact token equality of greedy generations, for lossless steps (attention backend, KV cache, compile)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from ..generate import Forward, Unsupported, decoder_for, parse_call, positions_of
from .metrics import logit_metrics

__all__ = ["greedy_outputs", "first_difference", "assert_same_tokens", "assert_token_identical", "decode_path_logits",
           "prompt_ids", "DecodePathReference", "decode_path_reference", "decode_path_compare", "DECODE_PATH_PROMPT",
           "DECODE_PATH_TOKENS"]

Prompt = str | torch.Tensor | Sequence[int]


def _is_ids(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(i, int) and not isinstance(i, bool) for i in x)


def prompt_ids(prompts: Prompt | Sequence[Prompt], tokenizer) -> list[torch.Tensor]:
    """Each prompt as ``[1, S]`` int64 token ids: one string, 1-d tensor or id list counts as one prompt, a
    ``[B, S]`` tensor as ``B``.

    Args:
        prompts: a prompt or a list of them (strings, token-id lists, tensors).
        tokenizer: encodes the string prompts; may be None when there are none.

    Returns:
        One ``[1, S]`` tensor per prompt.

    Raises:
        ValueError: an empty list, a string without a tokenizer, or a tensor of more than 2 dimensions.

    Example:
        >>> [tuple(t.shape) for t in prompt_ids([[1, 2, 3], torch.zeros(2, 4, dtype=torch.long)], None)]
        [(1, 3), (1, 4), (1, 4)]
    """
    if isinstance(prompts, (str, torch.Tensor)) or _is_ids(prompts):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of strings, token-id lists or tensors, got {prompts!r}")
    out: list[torch.Tensor] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(f"prompt {i} is a string; pass tokenizer= (or token ids)")
            ids = tokenizer(p, return_tensors="pt")["input_ids"]
            out.append(ids)
        elif isinstance(p, torch.Tensor):
            if p.dim() == 1:
                out.append(p.unsqueeze(0))
            elif p.dim() == 2:
                out.extend(row.unsqueeze(0) for row in p)
            else:
                raise ValueError(f"prompt {i} has shape {tuple(p.shape)}; pass [S] or [B, S] token ids")
        elif isinstance(p, (list, tuple)) and (not p or _is_ids(p)):
            out.append(torch.tensor([list(p)], dtype=torch.long))  # [1, S]; S = 0 is caught below
        else:
            raise ValueError(f"prompt {i} is a {type(p).__name__}; pass a string, a list of token ids or a tensor")
    for i, ids in enumerate(out):
        if ids.shape[-1] == 0:
            raise ValueError(f"prompt {i} is empty")
        if ids.is_floating_point():
            raise ValueError(f"prompt {i} holds {ids.dtype} values; token ids are integers")
    return [ids.long() for ids in out]


@torch.inference_mode()
def greedy_outputs(model: nn.Module, prompts: Prompt | Sequence[Prompt], max_new_tokens: int = 32, *,
                   tokenizer=None) -> list[list[int]]:
    """Greedy continuations of each prompt, through ``model.generate`` (batch 1 per prompt, no padding).

    Record them before an optimization and compare after with :func:`assert_same_tokens`; this is how
    a lossless step is checked on one model object. Generation stops at ``max_new_tokens`` or at the
    model's end-of-sequence token.

    Args:
        model: a transformers causal LM (optimized or not: its own ``generate`` is called).
        prompts: one prompt or a list; each a string (needs ``tokenizer``), a list of token ids, or a
            ``[S]`` / ``[B, S]`` id tensor (each row a prompt).
        max_new_tokens: tokens to generate per prompt.
        tokenizer: the model's tokenizer, for string prompts.

    Returns:
        One list of generated token ids (prompt excluded) per prompt.

    Raises:
        ValueError: ``max_new_tokens <= 0``; an empty or malformed prompt; a string without a tokenizer.

    Example:
        >>> from infopt.models import tiny_model
        >>> out = greedy_outputs(tiny_model(), [[1, 17, 400], torch.tensor([5, 6])], max_new_tokens=4)
        >>> [len(o) for o in out]
        [4, 4]
    """
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
    device = next(model.parameters()).device
    gc = model.generation_config
    pad = gc.pad_token_id if gc.pad_token_id is not None else gc.eos_token_id
    if isinstance(pad, (list, tuple)):
        pad = pad[0]
    out = []
    for ids in prompt_ids(prompts, tokenizer):
        ids = ids.to(device)
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad)
        out.append(seq[0, ids.shape[1]:].tolist())
    return out


def _at(seq: list[int], pos: int, tokenizer) -> str:
    if pos >= len(seq):
        return f"ended after {len(seq)} tokens"
    return f"has {seq[pos]}" + (f" {tokenizer.decode([seq[pos]])!r}" if tokenizer is not None else "")


def _show(ids: Sequence[int], tokenizer) -> str:
    return repr(tokenizer.decode(list(ids))) if tokenizer is not None else str(list(ids))


def first_difference(expected: Sequence[int], actual: Sequence[int]) -> int | None:
    """Where two token sequences first differ.

    Args:
        expected, actual: token ids (e.g. two continuations of one prompt).

    Returns:
        The first index where they differ (a length difference counts at the shorter one's end), or None when they
        are identical.

    Example:
        >>> first_difference([5, 6, 7], [5, 9, 7]), first_difference([5, 6], [5, 6, 7]), first_difference([1], [1])
        (1, 2, None)
    """
    a, b = list(expected), list(actual)
    if a == b:
        return None
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def assert_same_tokens(expected: Sequence[Sequence[int]], actual: Sequence[Sequence[int]], *, tokenizer=None,
                       names: tuple[str, str] = ("expected", "actual"),
                       prompt_lengths: Sequence[int] | None = None) -> None:
    """Raise AssertionError at the first prompt whose continuations differ, naming where.

    Args:
        expected, actual: from :func:`greedy_outputs` (one id list per prompt), same number of prompts.
        tokenizer: decode continuations in the message (token ids are shown otherwise).
        names: labels of the two sides in the message.
        prompt_lengths: prompt lengths, to also report the position in the whole sequence.

    Returns:
        None when every continuation is identical token for token (lengths included).

    Raises:
        AssertionError: a continuation differs; the message gives the prompt index, the first
            diverging generated-token position (0 = first generated token), both tokens there and
            both continuations.
        ValueError: the two lists hold different numbers of prompts.

    Example:
        >>> assert_same_tokens([[5, 6, 7]], [[5, 6, 7]])
        >>> assert_same_tokens([[5, 6, 7]], [[5, 9, 7]])
        Traceback (most recent call last):
        ...
        AssertionError: greedy outputs differ for prompt 0 at generated token 1: expected has 6, actual has 9
          expected: [5, 6, 7]
          actual: [5, 9, 7]
    """
    if len(expected) != len(actual):
        raise ValueError(f"{names[0]} has {len(expected)} prompt(s) but {names[1]} has {len(actual)}; record both "
                         "with the same prompts")
    a_name, b_name = names
    for i, (a, b) in enumerate(zip(expected, actual, strict=True)):
        a, b = list(a), list(b)
        pos = first_difference(a, b)
        if pos is None:
            continue

        where = f" (sequence position {prompt_lengths[i] + pos})" if prompt_lengths is not None else ""
        raise AssertionError(
            f"greedy outputs differ for prompt {i} at generated token {pos}{where}: {a_name} {_at(a, pos, tokenizer)}, "
            f"{b_name} {_at(b, pos, tokenizer)}\n"
            f"  {a_name}: {_show(a, tokenizer)}\n  {b_name}: {_show(b, tokenizer)}")


def assert_token_identical(model_a: nn.Module, model_b: nn.Module, prompts: Prompt | Sequence[Prompt],
                           max_new_tokens: int = 32, *, tokenizer=None) -> None:
    """Assert two models produce the same greedy tokens for every prompt (the check for lossless steps).

    For a before/after check on one object (optimizing in place), record with
    :func:`greedy_outputs` before and use :func:`assert_same_tokens` after; passing the same object
    twice here only compares it with itself.

    Args:
        model_a, model_b: the two models, e.g. an original and an optimized copy.
        prompts: as for :func:`greedy_outputs`.
        max_new_tokens: tokens to generate per prompt.
        tokenizer: needed for string prompts; also decodes the continuations in the message.

    Returns:
        None when all continuations are equal token for token.

    Raises:
        AssertionError: the first prompt whose outputs differ, with the first diverging position
            and both continuations (see :func:`assert_same_tokens`).
        ValueError: bad prompts or ``max_new_tokens``.

    Example:
        >>> import copy
        >>> from infopt.models import tiny_model
        >>> m = tiny_model()
        >>> assert_token_identical(m, copy.deepcopy(m), [[1, 17, 400, 23]], max_new_tokens=8)
    """
    ids = prompt_ids(prompts, tokenizer)
    a = greedy_outputs(model_a, ids, max_new_tokens)
    b = greedy_outputs(model_b, ids, max_new_tokens)
    assert_same_tokens(a, b, tokenizer=tokenizer, names=("model_a", "model_b"),
                       prompt_lengths=[int(x.shape[-1]) for x in ids])


@torch.no_grad()
def decode_path_logits(model: nn.Module, input_ids: torch.Tensor, continuation: torch.Tensor) -> torch.Tensor:
    """The logits ``model``'s own decode path gives each token of ``continuation``, teacher-forced.

    The prompt runs through the prefill, then each token of ``continuation`` but the last through one decode step,
    on the cache and forward the model's recipe installed (a static cache, a compiled step with CUDA graphs), or on
    a dynamic cache and eager forwards for a plain model. This measures what a compiled decode step computes:
    ``model(ids)`` on the whole sequence runs the eager prefill path instead.

    Args:
        model: a causal LM, optimized or not.
        input_ids: ``[1, T]`` prompt ids.
        continuation: ``[N]`` or ``[1, N]`` tokens after the prompt (e.g. plain ``generate``'s greedy output).

    Returns:
        ``[N, V]`` fp32 logits: row ``i`` predicts ``continuation[i]``.

    Example:
        >>> from infopt.models import tiny_model
        >>> m = tiny_model(); ids = torch.tensor([[1, 17, 400]])
        >>> out = m.generate(ids, max_new_tokens=4, do_sample=False)
        >>> logits = decode_path_logits(m, ids, out[0, 3:])
        >>> logits.shape[0], torch.equal(logits.argmax(-1), out[0, 3:])
        (4, True)
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"decode_path_logits takes one prompt, input_ids [1, T]; got shape {tuple(input_ids.shape)}")
    cont = continuation.reshape(-1).to(input_ids.device)
    T, N = input_ids.shape[1], cont.numel()
    if N == 0:
        raise ValueError("decode_path_logits needs at least one continuation token")
    call = parse_call(model, (input_ids,), {"max_new_tokens": N, "do_sample": False})
    dec = decoder_for(model)
    if dec is not None:
        cache, forward = dec.open_cache(call), dec.forward_for()
    else:
        cache, forward = DynamicCache(config=model.config), Forward(model)
    try:
        # each row copied at once: a step replayed as a CUDA graph returns the graph's own output buffer, which the
        # next replay overwrites
        rows = [forward.prefill(input_ids, positions_of(call), None, cache)[:, -1].to(torch.float32, copy=True)]
        for i in range(N - 1):
            slot = torch.tensor([T + i], device=input_ids.device)
            logits = forward.step(cont[i].view(1, 1), slot.view(1, 1), slot, None, cache, first=T + i)
            rows.append(logits[:, -1].to(torch.float32, copy=True))
    finally:
        if dec is not None:
            dec.close_cache(call, None)
    return torch.cat(rows)


DECODE_PATH_PROMPT, DECODE_PATH_TOKENS = 16, 32
"""The decode-path check's prompt (the first tokens of the reference text) and the greedy tokens it follows."""


@dataclass(frozen=True)
class DecodePathReference:
    """The original model's greedy continuation of a prompt and its decode-path logits along it
    (:func:`decode_path_reference`), what :func:`decode_path_compare` measures an optimized model's decode path
    against.

    Attributes:
        input_ids: ``[1, T]`` the prompt, on the model's device.
        continuation: ``[N]`` the original's greedy tokens after it.
        logits: ``[N, V]`` fp32: the original's logits for each of them (:func:`decode_path_logits`).
    """

    input_ids: torch.Tensor
    continuation: torch.Tensor
    logits: torch.Tensor


def decode_path_reference(model: nn.Module, input_ids: torch.Tensor, *, prompt_tokens: int = DECODE_PATH_PROMPT,
                          new_tokens: int = DECODE_PATH_TOKENS) -> DecodePathReference:
    """Record ``model``'s greedy continuation of the first ``prompt_tokens`` of ``input_ids`` (``new_tokens`` of
    them, EOS or not) and its decode-path logits along it, before optimizing.

    Args:
        model: the original model (or the model as it is before the steps to measure).
        input_ids: ``[1, T]`` ids (a :class:`~infopt.eval.Reference`'s); the first ``prompt_tokens`` are the prompt.
        prompt_tokens, new_tokens: the prompt's and the continuation's lengths.

    Returns:
        A :class:`DecodePathReference`.

    Example:
        >>> from infopt.models import tiny_model
        >>> ref = decode_path_reference(tiny_model(), torch.tensor([[1, 17, 400, 23]]), new_tokens=5)
        >>> tuple(ref.input_ids.shape), tuple(ref.continuation.shape), ref.logits.shape[0]
        ((1, 4), (5,), 5)
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(f"decode_path_reference takes one prompt of at least one token, input_ids [1, T]; got shape "
                         f"{tuple(input_ids.shape)}")
    if prompt_tokens < 1 or new_tokens < 1:
        raise ValueError(f"decode_path_reference needs prompt_tokens >= 1 and new_tokens >= 1; got {prompt_tokens}, "
                         f"{new_tokens}")
    device = next(model.parameters()).device
    prompt = input_ids[:, :prompt_tokens].to(device)
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
    cont = out[0, prompt.shape[1]:]
    return DecodePathReference(prompt, cont, decode_path_logits(model, prompt, cont))


def decode_path_compare(model: nn.Module, reference: DecodePathReference) -> dict[str, float]:
    """KL (mean and max) and top-1 agreement of ``model``'s own decode path (its cache, its compiled step, one token
    per step; :func:`decode_path_logits`), teacher-forced along the original's greedy tokens, against the
    original's logits there. A whole-sequence :func:`~infopt.eval.compare` runs the prompt path instead, which
    differs where a step computes decode otherwise (int8-activation int4 layers run a bf16 GEMM from 64 rows).

    Args:
        model: the (optimized) model.
        reference: from :func:`decode_path_reference`, made before optimizing.

    Returns:
        ``{"kl", "kl_max", "top1", "tokens"}``: KL in nats/token over ``tokens`` decode positions. Where the model
        hands a call as long as the reference's to transformers' ``generate`` (a static cache's ``max_length``), the
        longest first half, quarter, ... of the continuation its own decode path serves; ``{"tokens": 0}`` where it
        serves not even the prompt and one token.

    Example:
        >>> from infopt.models import tiny_model
        >>> m = tiny_model()
        >>> decode_path_compare(m, decode_path_reference(m, torch.tensor([[1, 17, 400]]), new_tokens=4))["kl"]
        0.0
    """
    n = reference.continuation.numel()
    while n:
        try:
            logits = decode_path_logits(model, reference.input_ids, reference.continuation[:n])
        except Unsupported:  # a call this long is not the model's own decode path: try a shorter one
            n //= 2
            continue
        m = logit_metrics(logits, reference.logits[:n])
        return {"kl": m["kl"], "kl_max": m["kl_max"], "top1": m["top1"], "tokens": n}
    return {"tokens": 0}
