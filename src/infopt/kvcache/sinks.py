"""StreamingLLM attention sinks: a KV cache of fixed size ``window`` (first tokens + most recent), for endless generation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch  # noqa: F401  (the docstring examples use it)
from torch import nn

from ..core.errors import IncompatibleModelError
from ..core.introspect import ModelInfo, context_length, inspect_model
from ..core.patch import register_hook
from ..core.step import ApplyContext, StepConfig, bad_field, register_step, register_transform
from ..generate import set_part
from .api import FreshCache, register_use, require_full_attention
from .sinks_cache import SinkCache, position_hook, rope_inv_freq

__all__ = ["Sinks", "use_", "SUPPORTED_ROPE_TYPES"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""Rope types whose frequencies do not change with the sequence length, so a key can be re-rotated by a delta."""


@register_step
@dataclass(frozen=True)
class Sinks(StepConfig):
    """StreamingLLM: keep the first ``num_sink_tokens`` tokens and the most recent ones, ``window`` tokens in all.

    A query attends to at most ``window`` tokens (itself included): the sinks and the
    ``window - num_sink_tokens`` newest. Positions are in-cache positions, as in StreamingLLM: the
    first token in the cache is position 0 and the new token ``window - 1``; when the window slides,
    cached keys are re-rotated to their new slots from the position they were written at (one
    rotation, so errors do not accumulate). Generation can run far beyond the model's context with
    constant memory; quality is measured, not assumed (``benchmarks/kvcache_quality.py``).

    Greedy output is token-identical to plain ``generate`` while prompt + new tokens <= ``window``.
    A prompt longer than ``window`` is attended in full once (prefill), then the cache keeps the window.
    Tested with the eager and sdpa attention backends; needs rotary position embeddings
    (rope types :data:`SUPPORTED_ROPE_TYPES`) and full-attention layers; left-padded batches go to the
    original ``generate``.

    Args:
        window: tokens the cache holds, sinks included.
        num_sink_tokens: first tokens always kept (StreamingLLM uses 4).

    Raises:
        RecipeError: non-positive ``window``; ``num_sink_tokens`` negative or not below ``window``.
        IncompatibleModelError (at validation): no rotary embedding (GPT-2), an unsupported rope type,
            sliding-window layers, or a ``window`` beyond the model's positions.

    Example:
        >>> import infopt
        >>> from infopt.models import tiny_model
        >>> m = infopt.optimize(tiny_model(), [Sinks(window=16, num_sink_tokens=4)])
        >>> m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=40, do_sample=False).shape
        torch.Size([1, 43])
    """

    stage: ClassVar[str] = "kvcache"
    kind: ClassVar[str] = "sinks"
    discriminator: ClassVar[str] = "kind"
    fidelity: ClassVar[str] = "lossy"
    window: int = 1024
    num_sink_tokens: int = 4

    def __post_init__(self):
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 2:
            raise bad_field(self, "window", self.window, "an integer >= 2 (tokens kept, sinks included)")
        s = self.num_sink_tokens
        if not isinstance(s, int) or isinstance(s, bool) or s < 0 or s >= self.window:
            raise bad_field(self, "num_sink_tokens", s,
                            f"an integer from 0 to window - 1 = {self.window - 1} (StreamingLLM uses 4)")

    def check(self, model, info: ModelInfo, steps) -> list[str]:
        require_full_attention(model, "kvcache.Sinks")
        try:
            _, rope_type = rope_inv_freq(model)
        except ValueError as e:
            raise IncompatibleModelError(
                f"kvcache.Sinks re-rotates cached keys, which needs rotary position embeddings: {e}. "
                "Use kvcache.HeavyHitter or kvcache.Quantized for this model"
            ) from None
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise IncompatibleModelError(
                f"kvcache.Sinks supports rope types {', '.join(SUPPORTED_ROPE_TYPES)}; this model uses '{rope_type}', "
                "whose frequencies change with the sequence length"
            )
        limit = context_length(model)
        if limit is not None and self.window > limit:
            raise IncompatibleModelError(
                f"kvcache.Sinks(window={self.window}) exceeds the model's {limit} positions; use window <= {limit}"
            )
        return []

    def new_cache(self, model: nn.Module):
        """A fresh :class:`~infopt.kvcache.sinks_cache.SinkCache` for ``model``. Forward calls with it need the
        position hook :func:`use_` installs (or ``make_room`` + ``position_ids`` by hand)."""
        return SinkCache(model.config, self.window, self.num_sink_tokens, rope_inv_freq(model)[0])


@register_use(Sinks)
def use_(model: nn.Module, config: Sinks, *, step: str | None = None) -> nn.Module:
    """Make ``model.generate`` decode with a fresh :class:`Sinks` cache per call, in place.

    Installs a forward pre-hook on ``model`` that, whenever a forward gets a
    :class:`~infopt.kvcache.sinks_cache.SinkCache`, evicts to make room and sets in-cache
    ``position_ids`` (so hand-written loops passing such a cache work too), and wraps ``generate``.
    Calls it cannot serve (beam search, left padding, a caller-supplied ``past_key_values``,
    ``use_cache=False``) go to the original ``generate``. :func:`infopt.undo` removes both.

    Args:
        model: a transformers causal LM with rotary embeddings.
        config: the :class:`Sinks` config.
        step: recipe step key for the report.

    Returns:
        The same model.

    Raises:
        IncompatibleModelError: see :meth:`Sinks.check`.

    Example:
        >>> from infopt.models import tiny_model
        >>> m = use_(tiny_model(), Sinks(window=8, num_sink_tokens=2))
        >>> m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=20, do_sample=False).shape
        torch.Size([1, 23])
    """
    info = inspect_model(model)
    config.check(model, info, (config,))
    key = step or config.key
    register_hook(model, model, position_hook, kind="forward_pre", step=key, with_kwargs=True)

    set_part(model, "cache", FreshCache(model, config, key, padding=False), step=key)
    return model


@register_transform(Sinks)
def _apply(model: nn.Module, config: Sinks, ctx: ApplyContext) -> None:
    use_(model, config)
    info = ctx.info or inspect_model(model)
    per_seq = info.kv_bytes_per_token * config.window
    ctx.stats.update({"kv_window_tokens": config.window, "kv_bytes_per_sequence_max": per_seq})
    ctx.notes.append(
        f"attention sinks: {config.num_sink_tokens} first + {config.window - config.num_sink_tokens} recent tokens, "
        f"KV cache flat at {per_seq / 2**20:.1f} MiB per sequence however long the generation"
    )
