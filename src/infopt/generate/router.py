"""The one wrapper on ``model.generate``: parse the call once, run one loop over the parts the steps supplied.

The first step that changes decoding installs a :class:`Decoder` on the model (wrapping the instance's
``generate`` once, recorded so :func:`infopt.undo` removes it); each step then sets its part:

- ``cache``: a :class:`CachePart` (kvcache: static, quantized, paged, sinks, heavy-hitter);
- ``forwards``: a factory of :class:`~infopt.generate.forward.Forward` per module (compile supplies compiled ones);
- ``speculative``: a :class:`LoopPart` that drafts and verifies (speculative);
- ``engine``: a :class:`LoopPart` that schedules rows as requests (batching).

A call is parsed into a :class:`~infopt.generate.call.GenerateCall` once. The engine serves it when present,
else the speculative loop, else the greedy/sampling loop; a call those loops cannot serve runs in
transformers' own loop on the cache part's cache, and a call nothing serves goes to the original ``generate``,
counted once with its reason.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from ..core.compat import CACHE_KWARG
from ..core.patch import ModelSlot, record_custom, wrap_method
from .call import GenerateCall, Unsupported, parse_call
from .forward import Forward, full_length_dynamic_cache
from .lean import lean_decode

__all__ = ["RoutingStats", "routing_stats", "Decoder", "decoder_for", "install", "set_part", "uncounted", "CachePart",
           "LoopPart", "tensors_bytes"]


@dataclass
class RoutingStats:
    """How a model's ``generate`` calls were served since it was optimized.

    Attributes:
        infopt: calls an infopt path served; ``loops`` says which (``lean``, ``speculative``, ``engine``,
            ``transformers+cache``: transformers' loop on an infopt cache).
        original: calls handed to the original ``generate``; ``reasons`` counts why.
    """

    infopt: int = 0
    original: int = 0
    reasons: Counter = field(default_factory=Counter)
    loops: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {"infopt": self.infopt, "original": self.original, "reasons": dict(self.reasons),
                "loops": dict(self.loops)}


class CachePart:
    """A KV cache kind the decoder opens per call.

    Attributes:
        key: the recipe step that supplied it.
        lean: infopt's loops may decode on it; False leaves every call to transformers' loop on the cache.
    """

    key = "kvcache"
    lean = True

    def open(self, call: GenerateCall, slots: int | None = None):
        """An empty cache for ``call`` with room for ``slots`` positions (default ``call.total_length``).

        Raises:
            Unsupported: a call this cache kind cannot serve, with the reason.
        """
        raise NotImplementedError

    def close(self, call: GenerateCall, out) -> None:
        """The call ended with ``out`` (None when it failed)."""

    def cache_for(self, model: nn.Module, batch: int, slots: int):
        """A cache of the same kind for another model (a speculative draft), one that can roll back; default a
        dynamic cache whose sliding-window layers keep every token (:func:`full_length_dynamic_cache`)."""
        return full_length_dynamic_cache(model.config)

    def resident(self, seen: set) -> dict[str, int]:
        """Bytes this part holds between calls, by what they are (a static cache kept for reuse, a KV pool);
        the report lists them beside the weights. Storages in ``seen`` (:func:`tensors_bytes`) are not counted
        again."""
        return {}


class LoopPart:
    """A decode loop a step supplies (speculative decoding, the batching engine)."""

    key = "loop"

    def serve(self, call: GenerateCall, decoder: Decoder) -> torch.Tensor:
        """Generate for ``call``, or raise :class:`Unsupported` with the reason."""
        raise NotImplementedError

    def takes(self, call: GenerateCall, decoder: Decoder) -> bool:
        """Whether this loop serves ``call`` (False: the decoder's plain loop does, on the same cache and forward)."""
        return True

    def resident(self, seen: set) -> dict[str, int]:
        """Bytes this part holds beside the model's weights (a draft model, a KV pool), by what they are; storages
        in ``seen`` are not counted again."""
        return {}


def tensors_bytes(tensors, seen: set | None = None) -> int:
    """Bytes of the distinct memory ``tensors`` (an iterable, None entries skipped) occupy, each storage once;
    ``seen`` (storage addresses) carries across calls so a stretch counted elsewhere is not counted again."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        try:
            storage = t.untyped_storage()
            key = storage.data_ptr() or id(t)
            size = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # an opaque tensor (oneDNN's packed layout)
            key, size = id(t), t.numel() * t.element_size()
        if key not in seen:
            seen.add(key)
            total += size
    return total


log = logging.getLogger("infopt")

# (pattern on an Unsupported reason, what the caller changes so infopt serves the call); the first match is used
_FIXES: tuple[tuple[str, str], ...] = (
    (r"^a streamer \(the engine", "stream from the engine itself: infopt.batching.batching_engine(model)"
     ".submit(prompt_ids).stream() yields the tokens as they are generated"),
    (r"^num_return_sequences", "repeat each prompt in the batch instead (input_ids.repeat_interleave(n, 0) and the "
     "same for attention_mask) and leave num_return_sequences at 1"),
    (r"^(num_beams|num_beam_groups|penalty_alpha|constraints|force_words_ids)",
     "beam search and the other search strategies run only in transformers' generate; greedy and sampling calls "
     "are served"),
    (r"^caller supplied (past_key_values|cache_params)", "leave the cache out of the call: the recipe's kvcache step "
     "supplies one per call"),
    (r"^caller supplied", "leave that argument out of the call"),
    (r"^cache_implementation", "leave cache_implementation unset (in the call and in model.generation_config): the "
     "recipe's kvcache step supplies the cache"),
    (r"^use_cache=False", "leave use_cache at True"),
    (r"^attention_mask is not left padding", "pad batches on the left (tokenizer.padding_side = 'left') and pass "
     "the attention_mask"),
    (r"^length \d+ > max_length", "give kvcache.Static a max_length that holds prompt + max_new_tokens (or leave it "
     "None: the model's context)"),
    (r"^batch \d+ != batch_size", "leave kvcache.Static's batch_size None, or call with that batch size"),
    (r"^pool too small", "give the paged cache more num_blocks (kvcache.Paged or batching), or shorten the calls"),
    (r"^stop_strings without tokenizer= in the call", "pass the tokenizer with the stop strings "
     "(generate(..., stop_strings=[...], tokenizer=tok)): transformers' own loop needs it too"),
    (r"^stop_strings without a tokenizer", "pass tokenizer= to infopt.optimize, so the batching step can match stop "
     "strings"),
    (r"^a batch without pad_token_id", "set pad_token_id (or eos_token_id) in the call or the generation config"),
    (r"^argument\(s\) ", "leave those arguments out of the call"),
    (r"^\w+=", "call generate with that setting left at its default"),
)


def _fallback_fix(reason: str) -> str:
    """What to change in a ``generate`` call so infopt serves it, for an :class:`Unsupported` ``reason``; a generic
    sentence for a reason without a specific fix.

    Example:
        >>> _fallback_fix("num_return_sequences=2")[:40]
        'repeat each prompt in the batch instead '
    """
    for pattern, fix in _FIXES:
        if re.match(pattern, reason):
            return fix
    return "see docs/architecture.md (How routing_stats counts) for the calls each path serves"


class Decoder:
    """The parts one model's ``generate`` calls are served with, and the counts of how they were served."""

    def __init__(self, model: nn.Module):
        self._model = weakref.ref(model)
        self.cache: CachePart | None = None
        self.speculative: LoopPart | None = None
        self.engine: LoopPart | None = None
        self.forwards: Callable[[nn.Module], Forward] | None = None
        self._forwards: weakref.WeakKeyDictionary[nn.Module, Forward] = weakref.WeakKeyDictionary()
        self.stats = RoutingStats()
        self.counting = True
        self._logged: set[tuple[str, str]] = set()  # (path, reason with its numbers blanked) already logged

    @property
    def model(self) -> nn.Module:
        return self._model()

    def forward_for(self, model: nn.Module | None = None) -> Forward:
        """The forward the loops call for ``model`` (default: the decoder's model): compiled when a compile step
        supplied the factory, else eager. One per module, kept across calls."""
        model = self.model if model is None else model
        fwd = self._forwards.get(model)
        if fwd is None:
            fwd = self.forwards(model) if self.forwards is not None else Forward(model)
            self._forwards[model] = fwd
        return fwd

    def open_cache(self, call: GenerateCall, slots: int | None = None, *, rollback: bool = False):
        """The cache part's cache for ``call``, or a dynamic cache when no kvcache step is present (with
        ``rollback``, one whose sliding-window layers keep every token, so speculative decoding can crop it)."""
        if self.cache is not None:
            return self.cache.open(call, slots)
        if rollback:
            return full_length_dynamic_cache(self.model.config)
        return DynamicCache(config=self.model.config)

    def close_cache(self, call: GenerateCall, out) -> None:
        if self.cache is not None:
            self.cache.close(call, out)

    def cache_for(self, model: nn.Module, batch: int, slots: int):
        """A cache for another model decoding beside this one (a draft), of the cache part's kind where it can."""
        return (self.cache or CachePart()).cache_for(model, batch, slots)

    # -- serving ----------------------------------------------------------------------------------------------
    def generate(self, original, *args, **kwargs):
        """Serve one ``model.generate(*args, **kwargs)`` call (the wrapper is this method with ``original`` bound).

        Kept flat on purpose: a served call reaches the model's forward through this frame, the loop and the
        forward object (docs/architecture.md shows the stack).
        """
        refused = reason = None
        try:
            call = parse_call(self.model, args, kwargs)
            # outside a caller's inference_mode: a reused cache must not become inference tensors a later call could
            # not reset, and a compiled step sees the same global state on every call
            with torch.inference_mode(False), torch.no_grad():
                if self.engine is not None:
                    out, loop = self.engine.serve(call, self), "engine"
                else:
                    out, loop = None, None
                    reason = call.lean_reason
                    if reason is None and (self.cache is None or self.cache.lean):
                        try:
                            if self.speculative is not None and self.speculative.takes(call, self):
                                out, loop = self.speculative.serve(call, self), "speculative"
                            else:
                                cache = self.open_cache(call)
                                try:
                                    out = lean_decode(call, cache, self.forward_for())
                                finally:
                                    self.close_cache(call, getattr(out, "sequences", out))
                                loop = "lean"
                        except Unsupported as why:
                            reason = str(why)
                    if loop is None:
                        out, loop = self._transformers_loop(original, call, reason), "transformers+cache"
        except Unsupported as why:
            refused = str(why)
        if refused is not None:  # outside the except block: the reason never shows in a user's traceback
            if self.counting:
                self.stats.original += 1
                self.stats.reasons[refused] += 1
                self._log_fallback("original", refused)
            return original(*args, **kwargs)
        if self.counting:
            self.stats.infopt += 1
            self.stats.loops[loop] += 1
            if loop == "transformers+cache" and reason is not None:
                self._log_fallback(loop, reason)
        return out

    def _log_fallback(self, path: str, reason: str) -> None:
        """Log a fall-back at WARNING once per reason for this model (a loop of such calls logs one line), with what
        to change; ``routing_stats`` still counts every call."""
        key = (path, re.sub(r"\d+(\.\d+)?", "N", reason))  # num_return_sequences=2 and =3 are one reason
        if key in self._logged:
            return
        self._logged.add(key)
        model = self.model
        name = type(model).__name__ if model is not None else "the model"
        if path == "original":
            what = "was handed to transformers' own generate, without the recipe's steps that act on decoding"
        else:
            what = ("ran in transformers' decode loop on infopt's KV cache, without infopt's own loop (its compiled "
                    "or speculative decode steps)")
        log.warning("infopt: a %s.generate call %s: %s. To have it served: %s. (Logged once per reason; "
                    "model.infopt.routing counts every call.)", name, what, reason, _fallback_fix(reason))

    def _transformers_loop(self, original, call: GenerateCall, reason: str | None):
        """transformers' own loop on the cache part's cache (processors, penalties, extra outputs, ...)."""
        if self.cache is None:
            raise Unsupported(reason)
        cache = self.cache.open(call)
        out = None
        try:
            out = original(*call.args, **{CACHE_KWARG: cache}, **call.kwargs)
        finally:
            self.cache.close(call, out if torch.is_tensor(out) else getattr(out, "sequences", None))
        return out


_DECODERS = ModelSlot("decoder")


def decoder_for(model: nn.Module) -> Decoder | None:
    """The :class:`Decoder` serving ``model.generate``, or None when no decoding step is applied."""
    return _DECODERS.get(model)


def install(model: nn.Module, *, step: str) -> Decoder:
    """The model's :class:`Decoder`, wrapping ``model.generate`` on first use (recorded for undo under ``step``)."""
    dec = _DECODERS.get(model)
    if dec is not None:
        return dec
    dec = Decoder(model)

    def make(original):
        generate = functools.partial(dec.generate, original)  # no frame of its own
        generate.__doc__ = getattr(original, "__doc__", None)
        generate.__wrapped__ = original  # type: ignore[attr-defined]
        return generate

    wrap_method(model, "generate", make, step=step)
    _DECODERS[model] = dec
    record_custom(model, "generate decoder", lambda: _DECODERS.pop(model, None), step=step)
    return dec


def set_part(model: nn.Module, name: str, part: Any, *, step: str) -> Decoder:
    """Give ``model``'s decoder its ``name`` part (``cache``, ``forwards``, ``speculative``, ``engine``).

    Raises:
        ValueError: an unknown part name, or a part of that name already set by another step.
    """
    if name not in ("cache", "forwards", "speculative", "engine"):
        raise ValueError(f"unknown decoder part {name!r}; use cache, forwards, speculative or engine")
    dec = install(model, step=step)
    if getattr(dec, name) is not None:
        raise ValueError(f"the model's generate already has a {name} part; call infopt.undo(model) first")
    setattr(dec, name, part)
    if name == "forwards":
        dec._forwards.clear()

    def remove():
        setattr(dec, name, None)
        dec._forwards.clear()

    record_custom(model, f"generate {name} part", remove, step=step)
    return dec


def routing_stats(model: nn.Module) -> RoutingStats:
    """The :class:`RoutingStats` of ``model`` (zeros for a model whose ``generate`` infopt does not serve).

    Example:
        >>> from infopt.models import tiny_model
        >>> routing_stats(tiny_model()).as_dict()
        {'infopt': 0, 'original': 0, 'reasons': {}, 'loops': {}}
    """
    dec = _DECODERS.get(model)
    return dec.stats if dec is not None else RoutingStats()


@contextlib.contextmanager
def uncounted(model: nn.Module):
    """Calls made inside (warm-ups while a recipe is applied) are not counted in :func:`routing_stats`."""
    dec = _DECODERS.get(model)
    if dec is None:
        yield
        return
    before, dec.counting = dec.counting, False
    try:
        yield
    finally:
        dec.counting = before
