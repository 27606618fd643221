"""A lean decode loop: one forward per token, preallocated output, no per-token logits-processor objects.

``transformers``' ``generate`` builds logits processors, stopping criteria and model-input dicts every
token; for a small model on a CPU that bookkeeping is a visible part of each token's time. This loop
does only what greedy decoding needs, with the same arithmetic as ``generate`` (positions from the
attention mask, the mask dropped when it has no padding, fp32 argmax of the last position's logits,
``min_new_tokens`` by masking EOS, finished rows padded), so its output is token-identical. Sampling
calls (temperature, top-k, top-p, min-p) use transformers' own warpers and ``torch.multinomial`` on the
global generator in ``generate``'s order, so a seeded call draws the same tokens. Calls it does not cover raise :class:`~infopt.core.generation.Unsupported` from :func:`plan_greedy` and go to
the original ``generate``.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .generation import Unsupported
from .patch import record_custom

__all__ = ["GreedyCall", "plan_greedy", "greedy_decode", "nondefault_fields", "call_input_ids", "call_generation_config",
           "takes_logits_to_keep", "DecodeStep", "set_decode_step", "decode_step_for", "sampling_field"]

# generate() kwargs this loop understands; anything else goes to the original generate
_KNOWN_KWARGS = {"input_ids", "attention_mask", "max_new_tokens", "min_new_tokens", "max_length", "do_sample",
                 "eos_token_id", "pad_token_id", "bos_token_id", "use_cache", "generation_config", "num_beams",
                 "num_return_sequences", "output_scores", "return_dict_in_generate", "temperature", "top_k", "top_p",
                 "tokenizer", "min_length", "streamer"}

# generation-config fields that must keep these values for plain greedy decoding
_GREEDY_DEFAULTS: dict[str, Any] = {
    "do_sample": False, "num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0, "bad_words_ids": None, "force_words_ids": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None,
    "guidance_scale": None, "stop_strings": None, "max_time": None, "output_scores": False, "output_logits": False,
    "output_attentions": False, "output_hidden_states": False, "return_dict_in_generate": False,
    "encoder_repetition_penalty": 1.0, "length_penalty": 1.0, "exponential_decay_length_penalty": None,
    "renormalize_logits": False, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "penalty_alpha": None,
    "low_memory": None, "watermarking_config": None, "assistant_model": None, "prompt_lookup_num_tokens": None,
    "min_length": 0, "typical_p": 1.0, "diversity_penalty": 0.0, "num_beam_groups": 1,
}


def call_input_ids(args: tuple, kwargs: dict[str, Any], known: set[str]) -> torch.Tensor:
    """The ``[B, T]`` ``input_ids`` of a ``generate(*args, **kwargs)`` call whose keywords are all in ``known``.

    Raises:
        Unsupported: extra positional arguments, an unknown keyword, no 2-D ids tensor, an empty prompt.
    """
    if len(args) > 1:
        raise Unsupported("positional arguments after input_ids")
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise Unsupported(f"argument(s) {', '.join(unknown)}")
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if input_ids is None or not torch.is_tensor(input_ids) or input_ids.dim() != 2:
        raise Unsupported("no 2-D input_ids tensor")
    if input_ids.shape[1] == 0:
        raise Unsupported("empty prompt")
    return input_ids


_NOT_CONFIG = ("input_ids", "attention_mask", "generation_config", "tokenizer", "use_cache", "streamer")


def call_generation_config(model: nn.Module, kwargs: dict[str, Any]):
    """A copy of the call's (or the model's) generation config with the call's generation keywords set on it."""
    gc = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    for k, v in kwargs.items():
        if k not in _NOT_CONFIG:
            setattr(gc, k, v)
    return gc


def nondefault_fields(gc, allow: tuple[str, ...] = ()) -> list[str]:
    """``field=value`` for each generation-config field that asks for more than plain greedy decoding
    (sampling, beams, penalties, extra outputs, ...), skipping the names in ``allow``."""
    out = []
    for field, default in _GREEDY_DEFAULTS.items():
        if field in allow:
            continue
        v = getattr(gc, field, default)
        if v is not None and v != default and not (default is None and v in ((), [])):
            out.append(f"{field}={v!r}")
    return out


DecodeStep = Callable[..., torch.Tensor]
"""``step(input_ids [B,1], position_ids [B,1], cache_position [1], attention_mask [B,L] | None, cache)`` ->
fp32 logits ``[B, V]`` of one decode token over a static cache of length ``L``: every argument keeps its
shape from token to token, which is what a compiled step needs."""

_DECODE_STEPS: weakref.WeakKeyDictionary[nn.Module, DecodeStep] = weakref.WeakKeyDictionary()


def set_decode_step(model: nn.Module, fn: DecodeStep, *, step: str | None = None) -> None:
    """Make the lean loop run ``model``'s one-token forwards through ``fn`` (undone with the recipe)."""
    _DECODE_STEPS[model] = fn
    record_custom(model, "decode step", lambda: _DECODE_STEPS.pop(model, None), step=step)


def decode_step_for(model: nn.Module) -> DecodeStep | None:
    """The decode step set with :func:`set_decode_step`, or None."""
    return _DECODE_STEPS.get(model)


@dataclass
class GreedyCall:
    """A ``generate`` call the lean loop serves: inputs and the resolved limits."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor | None  # [B, T] or None
    max_new_tokens: int
    min_new_tokens: int
    eos_token_ids: torch.Tensor | None  # [E]
    pad_token_id: int | None
    streamer: Any = None  # gets the prompt, then each step's tokens, then end(), as generate does
    warpers: Any = None  # a LogitsProcessorList for sampling (torch.multinomial), or None for greedy argmax


def _as_ids(v) -> list[int] | None:
    if v is None:
        return None
    if torch.is_tensor(v):
        return [int(x) for x in v.reshape(-1).tolist()]
    if isinstance(v, int):
        return [v]
    return [int(x) for x in v]


_SAMPLING_FIELDS = ("do_sample", "temperature", "top_k", "top_p")


def sampling_field(gc, name: str):
    """``gc.<name>``, or generate's global default when unset (``generate`` fills unset fields, e.g. top_k 50)."""
    v = getattr(gc, name, None)
    if v is not None:
        return v
    get_defaults = getattr(gc, "_get_default_generation_params", None)
    defaults = get_defaults() if callable(get_defaults) else {"temperature": 1.0, "top_k": 50, "top_p": 1.0}
    return defaults.get(name)


def _warpers(gc):
    """transformers' own sampling warpers for ``gc``, in the order ``generate`` applies them."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    temperature, top_k, top_p = (sampling_field(gc, n) for n in ("temperature", "top_k", "top_p"))
    out = LogitsProcessorList()
    if temperature is not None and temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if getattr(gc, "top_h", None) is not None:
        raise Unsupported(f"top_h={gc.top_h}")
    if top_k is not None and top_k != 0:
        out.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p is not None and top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    if getattr(gc, "min_p", None) is not None:
        out.append(MinPLogitsWarper(min_p=gc.min_p, min_tokens_to_keep=1))
    return out


def plan_greedy(model: nn.Module, args: tuple, kwargs: dict[str, Any], *, sampling: bool = False) -> GreedyCall:
    """Resolve a ``generate(*args, **kwargs)`` call for the lean loop, or raise :class:`Unsupported`.

    Args:
        model: the model whose ``generate`` was called.
        args, kwargs: the call's arguments.
        sampling: also take ``do_sample`` calls with temperature / top-k / top-p / min-p; they
            sample with transformers' own warpers and ``torch.multinomial`` on the global generator, as
            ``generate`` does, so a seeded call draws the same tokens.

    Returns:
        The resolved :class:`GreedyCall`.

    Raises:
        Unsupported: the call needs something the loop does not do (sampling, beams, logits
            processors, a streamer with batch > 1, scores, ...); the message says what.
    """
    input_ids = call_input_ids(args, kwargs, _KNOWN_KWARGS | ({"min_p"} if sampling else set()))
    gc = call_generation_config(model, kwargs)
    sample = sampling and bool(getattr(gc, "do_sample", False))
    bad = nondefault_fields(gc, allow=_SAMPLING_FIELDS if sample else ())
    if bad:
        raise Unsupported(bad[0])
    warpers = _warpers(gc) if sample else None
    if getattr(gc, "use_cache", True) is False or kwargs.get("use_cache") is False:
        raise Unsupported("use_cache=False")
    prompt = input_ids.shape[1]
    if getattr(gc, "max_new_tokens", None) is not None:
        new = int(gc.max_new_tokens)
    else:
        new = int(gc.max_length if gc.max_length is not None else 20) - prompt
    if new <= 0:
        raise Unsupported("no new tokens requested")
    min_new = int(getattr(gc, "min_new_tokens", None) or 0)
    eos = _as_ids(gc.eos_token_id)
    pad = gc.pad_token_id
    if pad is None and eos:
        pad = eos[0]
    mask = kwargs.get("attention_mask")
    if mask is not None and (not torch.is_tensor(mask) or mask.shape != input_ids.shape):
        raise Unsupported("attention_mask not the shape of input_ids")
    eos_t = torch.tensor(eos, device=input_ids.device) if eos else None
    streamer = kwargs.get("streamer")
    if streamer is not None and input_ids.shape[0] != 1:
        raise Unsupported("a streamer with batch > 1")  # generate refuses it too
    return GreedyCall(input_ids, mask, new, min(min_new, new), eos_t, None if pad is None else int(pad), streamer,
                      warpers)


@torch.no_grad()  # not inference_mode: a cache allocated lazily here must stay writable by later calls (reset)
def greedy_decode(model: nn.Module, call: GreedyCall, cache, *, step: DecodeStep | None = None,
                  cache_length: int | None = None) -> torch.Tensor:
    """Run greedy decoding for ``call`` with ``cache`` (a transformers ``Cache``, empty).

    Args:
        model: the model (its forward runs the prompt, and the decode tokens when ``step`` is None).
        call: the resolved call.
        cache: an empty cache; filled in place.
        step: a :data:`DecodeStep` for the one-token forwards (a compiled one), or None for ``model``.
        cache_length: the static cache's length; needed with ``step`` (a padded batch's mask is
            given to the step at that length, so its shape never changes).

    Returns:
        ``[B, T + n]`` token ids, ``n <= max_new_tokens`` (shorter when every row hit EOS), as
        ``generate`` returns them.
    """
    ids = call.input_ids
    B, T = ids.shape
    out = torch.empty(B, T + call.max_new_tokens, dtype=ids.dtype, device=ids.device)
    out[:, :T] = ids
    mask = call.attention_mask
    if mask is not None:
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)  # [B, T]
        if bool(mask.all()):
            mask = None  # no padding: generate drops the mask too
    else:
        positions = torch.arange(T, device=ids.device).unsqueeze(0).expand(B, T)
    full_mask = None
    if mask is not None:
        width = T + call.max_new_tokens
        if step is not None:
            if cache_length is None or cache_length < width:
                raise ValueError(f"a decode step needs the static cache's length (>= {width}); got {cache_length}")
            width = cache_length  # positions past the current token are causally masked anyway
        full_mask = torch.ones(B, width, dtype=mask.dtype, device=mask.device)
        full_mask[:, :T] = mask
    next_pos = positions[:, -1:] + 1  # [B, 1]
    cache_position = torch.tensor([T], device=ids.device)  # cache slot of the next decode token
    unfinished = torch.ones(B, dtype=torch.bool, device=ids.device)
    eos = call.eos_token_ids
    pad = call.pad_token_id
    warpers = call.warpers
    logits_to_keep = {"logits_to_keep": 1} if takes_logits_to_keep(model) else {}
    streamer = call.streamer
    if streamer is not None:
        streamer.put(ids.cpu())

    logits = model(input_ids=ids, attention_mask=full_mask[:, :T] if full_mask is not None else None,
                   position_ids=positions, past_key_values=cache, use_cache=True, **logits_to_keep).logits[:, -1]
    n = 0
    while True:
        scores = logits.to(dtype=torch.float32, copy=True)  # [B, V]; a copy: processors write in place
        if eos is not None and n < call.min_new_tokens:
            scores[:, eos] = -float("inf")
        if warpers is None:
            tok = scores.argmax(dim=-1)  # [B]
        else:
            scores = warpers(out[:, : T + n], scores)
            tok = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        if eos is not None and pad is not None:
            tok = torch.where(unfinished, tok, torch.full_like(tok, pad))
        out[:, T + n] = tok
        if streamer is not None:
            streamer.put(tok.cpu())
        n += 1
        if eos is not None:
            unfinished &= ~torch.isin(tok, eos)
            if not bool(unfinished.any()):
                break
        if n == call.max_new_tokens:
            break
        if step is not None:
            logits = step(tok[:, None], next_pos, cache_position, full_mask, cache)
            cache_position = cache_position + 1
        else:
            cur = T + n
            logits = model(input_ids=tok[:, None], position_ids=next_pos,
                           attention_mask=full_mask[:, :cur] if full_mask is not None else None,
                           past_key_values=cache, use_cache=True, **logits_to_keep).logits[:, -1]
        next_pos = next_pos + 1
    if streamer is not None:
        streamer.end()
    return out[:, : T + n]


_TAKES: dict[type, bool] = {}


def takes_logits_to_keep(model: nn.Module) -> bool:
    """True when ``model.forward`` accepts ``logits_to_keep`` (so only the needed positions reach the head)."""
    import inspect

    t = type(model)
    if t not in _TAKES:
        _TAKES[t] = "logits_to_keep" in inspect.signature(t.forward).parameters
    return _TAKES[t]
