"""Routing ``model.generate`` calls: infopt's path for calls a step supports, the original for the rest.

A step that changes decoding wraps the instance's ``generate`` with :func:`route_generate`. Its
handler either serves the call or raises :class:`Unsupported` with a reason; the call then goes to the
generate it wrapped, so a pipeline never breaks, and the per-model counters say how often each happened.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .patch import PatchRecord, record_custom, wrap_method

__all__ = ["Unsupported", "RoutingStats", "routing_stats", "route_generate", "SAMPLING_ONLY_KWARGS"]


class Unsupported(Exception):
    """Raised by a generate handler for a call it does not serve; the message is the reason."""


@dataclass
class RoutingStats:
    """How a model's ``generate`` calls were served since it was optimized."""

    infopt: int = 0
    original: int = 0
    reasons: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {"infopt": self.infopt, "original": self.original, "reasons": dict(self.reasons)}


_STATS: weakref.WeakKeyDictionary[nn.Module, RoutingStats] = weakref.WeakKeyDictionary()

# generate() arguments that select decoding strategies infopt's loops do not implement
SAMPLING_ONLY_KWARGS = ("num_beams", "num_beam_groups", "penalty_alpha", "constraints", "force_words_ids")


def routing_stats(model: nn.Module) -> RoutingStats:
    """The :class:`RoutingStats` of ``model`` (zeros for a model never routed)."""
    stats = _STATS.get(model)
    if stats is None:
        stats = RoutingStats()
        _STATS[model] = stats
    return stats


def route_generate(
    model: nn.Module,
    handler: Callable[..., Any],
    *,
    step: str,
) -> PatchRecord:
    """Wrap ``model.generate`` so ``handler(original_generate, *args, **kwargs)`` serves each call.

    Args:
        model: the model whose instance ``generate`` is wrapped.
        handler: serves a call, or raises :class:`Unsupported` (reason in the message) to hand it
            to the generate it wrapped.
        step: recipe step key, for the report.
    """

    def make(original):
        def generate(*args, **kwargs):
            stats = routing_stats(model)
            try:
                out = handler(original, *args, **kwargs)
            except Unsupported as why:
                stats.original += 1
                stats.reasons[f"{step}: {why}"] += 1
                return original(*args, **kwargs)
            stats.infopt += 1
            return out

        generate.__doc__ = getattr(original, "__doc__", None)
        generate.__wrapped__ = original  # type: ignore[attr-defined]
        return generate

    record = wrap_method(model, "generate", make, step=step)
    record_custom(model, "routing stats", lambda: _STATS.pop(model, None), step=step)
    return record
