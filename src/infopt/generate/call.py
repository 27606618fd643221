"""One parse of a ``model.generate(...)`` call: a frozen :class:`GenerateCall`, or :class:`Unsupported` with the reason.

Every decode loop (greedy/sampling, speculative, the batching engine) and every cache part reads the same
parsed call, so the new-token arithmetic, the padding map and the sampling settings are worked out once.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.compat import CACHE_KWARGS

__all__ = ["Unsupported", "GenerateCall", "parse_call", "nondefault_fields", "sampling_field", "BEAM_KWARGS",
           "PENALTIES", "OUTPUTS"]


class Unsupported(Exception):
    """A call (or a part of it) infopt does not serve; the message is the reason. The call then goes to the
    original ``generate``, and :func:`~infopt.generate.routing_stats` counts it with the reason."""


# generate() arguments that select decoding strategies no infopt loop implements and no infopt cache serves
BEAM_KWARGS = ("num_beams", "num_beam_groups", "penalty_alpha", "constraints", "force_words_ids")

# keywords the parse understands; any other keyword leaves the call to transformers' own loop (with an infopt
# cache where a cache step is present)
_KNOWN = {"input_ids", "attention_mask", "max_new_tokens", "min_new_tokens", "max_length", "do_sample",
          "eos_token_id", "pad_token_id", "bos_token_id", "use_cache", "generation_config", "num_beams",
          "num_return_sequences", "output_scores", "return_dict_in_generate", "temperature", "top_k", "top_p", "min_p",
          "tokenizer", "min_length", "streamer", "stop_strings", "repetition_penalty", "no_repeat_ngram_size", "output_logits"}

# keywords that are not generation-config fields
_NOT_CONFIG = ("input_ids", "attention_mask", "generation_config", "tokenizer", "use_cache", "streamer")

# generation-config fields that must keep these values for infopt's own loops (sampling fields aside)
_PLAIN: dict[str, Any] = {
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
_SAMPLING = ("do_sample", "temperature", "top_k", "top_p", "min_p")
OUTPUTS = ("return_dict_in_generate", "output_scores", "output_logits")
"""Generation-config fields asking for more than the tokens that the lean loop returns as ``generate`` does (a
``GenerateDecoderOnlyOutput`` with the processed scores and the raw logits of each step); the speculative loop and
the batching engine return tokens only."""
PENALTIES = ("repetition_penalty", "no_repeat_ngram_size")
"""Generation-config fields the lean loop applies with transformers' own logits processors (the speculative loop and
the batching engine do not: such a call runs in the lean loop or in transformers' loop)."""


def nondefault_fields(gc, allow: tuple[str, ...] = ()) -> list[str]:
    """``field=value`` for each generation-config field that asks for more than plain decoding (beams,
    penalties, extra outputs, ...), skipping the names in ``allow``.

    Example:
        >>> from transformers import GenerationConfig
        >>> nondefault_fields(GenerationConfig(repetition_penalty=1.2))
        ['repetition_penalty=1.2']
    """
    out = []
    for name, default in _PLAIN.items():
        if name in allow:
            continue
        v = getattr(gc, name, default)
        if v is not None and v != default and not (default is None and v in ((), [])):
            out.append(f"{name}={v!r}")
    return out


def sampling_field(gc, name: str):
    """``gc.<name>``, or generate's global default when unset (``generate`` fills unset fields, e.g. top_k 50).

    Example:
        >>> from transformers import GenerationConfig
        >>> sampling_field(GenerationConfig(do_sample=True), "top_k")
        50
    """
    v = getattr(gc, name, None)
    if v is not None:
        return v
    get_defaults = getattr(gc, "_get_default_generation_params", None)
    defaults = get_defaults() if callable(get_defaults) else {"temperature": 1.0, "top_k": 50, "top_p": 1.0}
    return defaults.get(name)


def _ids(v) -> tuple[int, ...]:
    if v is None:
        return ()
    if torch.is_tensor(v):
        return tuple(int(x) for x in v.reshape(-1).tolist())
    if isinstance(v, int):
        return (v,)
    return tuple(int(x) for x in v)


@dataclass(frozen=True, eq=False)
class GenerateCall:
    """A parsed ``generate`` call.

    Attributes:
        args, kwargs: the call as made (handed on unchanged when transformers' own loop serves it).
        input_ids: ``[B, T]`` prompt ids; ``attention_mask``: ``[B, T]`` as given, or None.
        padded: the mask holds zeros. ``left_pads``: padding columns per row when the padding is left padding
            (zeros for an unpadded call), None for any other padding.
        max_new_tokens, min_new_tokens: resolved new-token limits (``min <= max``).
        do_sample, temperature, top_k, top_p, min_p: sampling settings, unset ones filled with generate's
            defaults (top_k 50); greedy calls keep ``do_sample=False``.
        eos_token_ids, pad_token_id: stop ids and the id finished rows are padded with (eos[0] when unset).
        streamer, stop_strings, tokenizer: as given.
        generation_config: a copy of the call's generation config with its keywords applied.
        penalties: ``field=value`` of each :data:`PENALTIES` field the call sets (only the lean loop applies them).
        outputs: the :data:`OUTPUTS` fields the call sets true, with ``return_dict_in_generate`` (else none: the
            tokens are the output); only the lean loop returns more than tokens.
        lean_reason: why infopt's own loops cannot serve this call (logits processors, penalties, extra
            outputs, ...), or None when they can; such a call can still run in transformers' loop on an
            infopt cache.
    """

    args: tuple
    kwargs: dict
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    padded: bool
    left_pads: tuple[int, ...] | None
    max_new_tokens: int
    min_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float
    min_p: float | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    streamer: Any
    stop_strings: tuple[str, ...]
    tokenizer: Any
    generation_config: Any
    penalties: tuple[str, ...]
    outputs: frozenset[str]
    lean_reason: str | None

    @property
    def batch(self) -> int:
        """Rows the decode runs: the prompts times ``num_return_sequences`` (``generate`` expands each prompt)."""
        n = getattr(self.generation_config, "num_return_sequences", 1) or 1
        return int(self.input_ids.shape[0]) * int(n)

    @property
    def prompt_length(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def total_length(self) -> int:
        """Prompt plus new tokens: the cache slots the call needs."""
        return self.prompt_length + self.max_new_tokens

    def eos_tensor(self) -> torch.Tensor | None:
        """``[E]`` EOS ids on the prompt's device, or None."""
        return torch.tensor(self.eos_token_ids, device=self.input_ids.device) if self.eos_token_ids else None

    def warpers(self):
        """transformers' own sampling warpers for this call, in ``generate``'s order (None for greedy).

        Raises:
            Unsupported: a warper infopt's loops do not apply (``top_h``).
        """
        if not self.do_sample:
            return None
        from transformers.generation.logits_process import (
            LogitsProcessorList,
            MinPLogitsWarper,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        if getattr(self.generation_config, "top_h", None) is not None:
            raise Unsupported(f"top_h={self.generation_config.top_h}")
        out = LogitsProcessorList()
        if self.temperature != 1.0:
            out.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k:
            out.append(TopKLogitsWarper(top_k=self.top_k, min_tokens_to_keep=1))
        if self.top_p < 1.0:
            out.append(TopPLogitsWarper(top_p=self.top_p, min_tokens_to_keep=1))
        if self.min_p is not None:
            out.append(MinPLogitsWarper(min_p=self.min_p, min_tokens_to_keep=1))
        return out

    def processors(self, model: nn.Module):
        """transformers' own logits processors for the call's :data:`PENALTIES` (None when it sets none), built by
        ``generate``'s own builder on a copy of the call's config that keeps only them, so each applies as the
        installed transformers applies it (5.24 leaves a row's left padding out of the repetition penalty, 5.17
        does not). They come first in ``generate``'s order, before its minimum-length masks and the sampling
        warpers, and neither changes what the other does: both leave ``-inf`` at ``-inf``.

        Raises:
            Unsupported: transformers' builder is not there, or built more than the penalties; or pad tokens without
                an attention mask (``generate`` would infer one the penalty reads).
        """
        if not self.penalties:
            return None
        if self.attention_mask is None and self.left_pads is None:
            raise Unsupported("a penalty with pad tokens and no attention_mask")
        from transformers.generation.logits_process import (
            LogitsProcessorList,
            NoRepeatNGramLogitsProcessor,
            RepetitionPenaltyLogitsProcessor,
        )

        gc = copy.deepcopy(self.generation_config)
        for name, default in _PLAIN.items():
            if name not in PENALTIES:
                setattr(gc, name, default)
        gc.min_new_tokens = None
        build = getattr(model, "_get_logits_processor", None)
        try:
            out = build(generation_config=gc, input_ids_seq_length=self.prompt_length, encoder_input_ids=self.input_ids,
                        logits_processor=LogitsProcessorList(), device=self.input_ids.device,
                        model_kwargs={"attention_mask": self.attention_mask})
        except (TypeError, AttributeError) as e:
            raise Unsupported(f"{self.penalties[0]} (transformers' logits-processor builder: {type(e).__name__})"
                              ) from e
        if not out or any(not isinstance(p, (RepetitionPenaltyLogitsProcessor, NoRepeatNGramLogitsProcessor))
                          for p in out):
            raise Unsupported(f"{self.penalties[0]} (transformers built {[type(p).__name__ for p in out]})")
        return out

    def stopping(self):
        """transformers' own ``StopStringCriteria`` for the call's ``stop_strings`` (None when it has none).

        Raises:
            Unsupported: stop strings without a ``tokenizer`` (transformers' own loop then says what is missing).
        """
        if not self.stop_strings:
            return None
        if self.tokenizer is None:
            raise Unsupported("stop_strings without tokenizer= in the call")
        from transformers.generation.stopping_criteria import StopStringCriteria

        return StopStringCriteria(tokenizer=self.tokenizer, stop_strings=list(self.stop_strings))


def _left_pads(input_ids: torch.Tensor, mask: torch.Tensor | None, pad: int | None,
               eos: tuple[int, ...]) -> tuple[int, ...] | None:
    batch, width = input_ids.shape
    if mask is None:
        # generate infers a mask from pad tokens when pad != eos; rather than guess the same way, call it unknown
        if pad is not None and pad not in eos and bool((input_ids == pad).any()):
            return None
        return (0,) * batch
    m = mask.detach().to("cpu").bool()
    real = m.sum(1)
    if bool((real == 0).any()):
        return None
    pads = width - real
    if not torch.equal(m, torch.arange(width)[None, :] >= pads[:, None]):
        return None
    return tuple(int(p) for p in pads.tolist())


def parse_call(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> GenerateCall:
    """Parse ``model.generate(*args, **kwargs)`` once for every infopt loop and cache.

    Args:
        model: the model whose ``generate`` was called.
        args, kwargs: the call.

    Returns:
        The :class:`GenerateCall`.

    Raises:
        Unsupported: a call no infopt path serves, with the reason: extra positional arguments, no 2-D
            ``input_ids`` tensor, an empty prompt, ``inputs_embeds``, a caller's ``past_key_values`` or
            ``cache_implementation``, ``use_cache=False``, beam search and the other strategies of
            :data:`BEAM_KWARGS`, assisted generation, a mask not shaped like the ids, no new tokens.

    Example:
        >>> from infopt.models import tiny_model
        >>> call = parse_call(tiny_model(), (torch.tensor([[1, 2, 3]]),), {"max_new_tokens": 4})
        >>> call.total_length, call.do_sample, call.lean_reason
        (7, False, None)
    """
    if len(args) > 1:
        raise Unsupported("positional arguments after input_ids")
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if input_ids is None or not torch.is_tensor(input_ids) or input_ids.dim() != 2:
        raise Unsupported("no 2-D input_ids tensor")
    if input_ids.shape[1] == 0:
        raise Unsupported("empty prompt")
    if input_ids.is_floating_point():
        raise Unsupported("input_ids are not integer token ids")
    for k in ("inputs_embeds", *CACHE_KWARGS, "assistant_model", "prompt_lookup_num_tokens"):
        if kwargs.get(k) is not None:
            raise Unsupported(f"caller supplied {k}")
    for k in BEAM_KWARGS:
        v = kwargs.get(k)
        if v not in (None, 1, False, 0):
            raise Unsupported(f"{k}={v}")
    gc = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    for k, v in kwargs.items():
        if k not in _NOT_CONFIG:
            setattr(gc, k, v)
    if getattr(gc, "num_beams", 1) not in (None, 1):
        raise Unsupported(f"num_beams={gc.num_beams} (beam search)")
    for k in ("assistant_model", "prompt_lookup_num_tokens"):
        if getattr(gc, k, None) is not None:
            raise Unsupported(f"{k} in the generation config")
    impl = getattr(gc, "cache_implementation", None)
    if impl is not None:
        raise Unsupported(f"cache_implementation={impl!r}")
    if kwargs.get("use_cache") is False or getattr(gc, "use_cache", True) is False:
        raise Unsupported("use_cache=False")
    mask = kwargs.get("attention_mask")
    if mask is not None and (not torch.is_tensor(mask) or tuple(mask.shape) != tuple(input_ids.shape)):
        raise Unsupported("attention_mask not the shape of input_ids")
    prompt = int(input_ids.shape[1])
    if getattr(gc, "max_new_tokens", None) is not None:
        new = int(gc.max_new_tokens)
    else:
        new = int(gc.max_length if gc.max_length is not None else 20) - prompt
    if new <= 0:
        raise Unsupported("no new tokens requested")
    eos = _ids(gc.eos_token_id)
    pad = gc.pad_token_id
    if pad is None and eos:
        pad = eos[0]
    pad = None if pad is None else int(_ids(pad)[0])
    padded = mask is not None and not bool(mask.bool().all())
    stop = gc.stop_strings or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    sample = bool(getattr(gc, "do_sample", False))

    lean = None
    unknown = sorted(set(kwargs) - _KNOWN)
    if unknown:
        lean = f"argument(s) {', '.join(unknown)}"
    else:
        bad = nondefault_fields(gc, allow=_SAMPLING + ("stop_strings",) + PENALTIES + OUTPUTS)
        if bad:
            lean = bad[0]
        elif kwargs.get("streamer") is not None and input_ids.shape[0] != 1:
            lean = "a streamer with batch > 1"
    min_p = getattr(gc, "min_p", None)
    return GenerateCall(
        args=args, kwargs=kwargs, input_ids=input_ids, attention_mask=mask, padded=padded,
        left_pads=_left_pads(input_ids, mask, pad, eos), max_new_tokens=new,
        min_new_tokens=min(int(getattr(gc, "min_new_tokens", None) or 0), new), do_sample=sample,
        temperature=float(sampling_field(gc, "temperature")) if sample else 1.0,
        top_k=(int(sampling_field(gc, "top_k") or 0) or None) if sample else None,
        top_p=float(sampling_field(gc, "top_p")) if sample else 1.0,
        min_p=float(min_p) if sample and min_p is not None else None,
        eos_token_ids=eos, pad_token_id=pad, streamer=kwargs.get("streamer"), stop_strings=stop,
        tokenizer=kwargs.get("tokenizer"), generation_config=gc,
        penalties=tuple(nondefault_fields(gc, allow=tuple(k for k in _PLAIN if k not in PENALTIES))),
        # (output_scores without return_dict_in_generate: generate returns the tokens alone, as every loop does)
        outputs=frozenset(k for k in OUTPUTS if getattr(gc, k, False) and gc.return_dict_in_generate), lean_reason=lean,
    )
