"""H2O heavy-hitter eviction: a KV cache bounded at ``budget`` tokens, keeping the recent and most-attended ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch  # noqa: F401  (the docstring examples use it)
from torch import nn

from ..attention.backends import set_backend_
from ..core.errors import IncompatibleModelError
from ..core.introspect import FAMILIES, ModelInfo, inspect_model
from ..core.patch import register_hook
from ..core.step import ApplyContext, StepConfig, bad_field, register_step, register_transform
from ..generate import Unsupported, set_part
from .api import FreshCache, register_use, require_full_attention
from .heavy_hitter_cache import HeavyHitterCache, attention_weights_hook

__all__ = ["HeavyHitter", "use_"]


def _nonneg_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


@register_step
@dataclass(frozen=True)
class HeavyHitter(StepConfig):
    """H2O: keep, per KV head, the ``recent`` newest tokens plus the older tokens with the largest
    accumulated attention, ``budget`` tokens in all.

    Scores are the attention weights each cached token received, summed over steps, queries and the
    query heads sharing its KV head. Only the eager attention backend returns weights: installing this
    cache **switches the model to eager attention** (recorded, so :func:`infopt.undo` switches back)
    and the report lists it as a fallback; a recipe pairing it with another attention backend is
    refused. Keys keep their true positions (H2O does not re-rotate). Greedy output is token-identical
    to plain eager ``generate`` while prompt + new tokens <= ``budget``; beyond, the cache stays at
    ``budget`` tokens. Left-padded batches go to the original ``generate``.

    Args:
        budget: tokens kept per KV head after each forward.
        recent: newest tokens always kept (0 to ``budget``).

    Raises:
        RecipeError: non-positive ``budget``; ``recent`` negative or above ``budget``.
        IncompatibleModelError (at validation): sliding-window layers; an attention step other than eager.

    Example:
        >>> import infopt
        >>> from infopt.models import tiny_model
        >>> m = infopt.optimize(tiny_model(), [HeavyHitter(budget=16, recent=4)])
        >>> m.config._attn_implementation
        'eager'
        >>> m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=30, do_sample=False).shape
        torch.Size([1, 33])
    """

    stage: ClassVar[str] = "kvcache"
    kind: ClassVar[str] = "heavy_hitter"
    discriminator: ClassVar[str] = "kind"
    fidelity: ClassVar[str] = "lossy"
    budget: int = 256
    recent: int = 64

    def __post_init__(self):
        if not _nonneg_int(self.budget) or self.budget == 0:
            raise bad_field(self, "budget", self.budget, "a positive integer (tokens kept per KV head)")
        if not _nonneg_int(self.recent) or self.recent > self.budget:
            raise bad_field(self, "recent", self.recent, f"an integer from 0 to budget={self.budget}")

    def check(self, model, info: ModelInfo, steps) -> list[str]:
        require_full_attention(model, "kvcache.HeavyHitter")
        attention = next((s for s in steps if s.stage == "attention"), None)
        if attention is not None:
            backend = getattr(attention, "backend", None)
            if backend != "eager":
                raise IncompatibleModelError(
                    f"kvcache.HeavyHitter reads attention weights, which only the eager backend returns; the recipe "
                    f"selects '{backend}'. Use attention backend 'eager' (or leave the attention step out)"
                )
            return []
        current = model.config._attn_implementation
        if current != "eager":
            return [f"attention backend {current} -> eager (H2O reads the attention weights, which only eager returns)"]
        return []

    def new_cache(self, model: nn.Module):
        """A fresh :class:`~infopt.kvcache.heavy_hitter_cache.HeavyHitterCache` for ``model`` (its forward needs
        the attention hooks :func:`use_` installs)."""
        return HeavyHitterCache(model.config, self.budget, self.recent)


def _attention_modules(model: nn.Module, info: ModelInfo) -> list[nn.Module]:
    family = FAMILIES[info.model_type]
    return [model.get_submodule(f"{fqn}.{family.attn}") for fqn in info.layer_fqns]


@register_use(HeavyHitter)
def use_(model: nn.Module, config: HeavyHitter, *, step: str | None = None) -> nn.Module:
    """Make ``model.generate`` decode with a fresh :class:`HeavyHitter` cache per call, in place.

    Switches the model to eager attention if needed, registers a forward hook on every attention
    module that hands its weights to a :class:`~infopt.kvcache.heavy_hitter_cache.HeavyHitterCache`
    (other caches are ignored), and wraps ``generate``. Calls it cannot serve (beam search, left
    padding, a caller-supplied ``past_key_values``, ``use_cache=False``, a backend switched away from
    eager since) go to the original ``generate``. :func:`infopt.undo` reverts all of it.

    Args:
        model: a transformers causal LM.
        config: the :class:`HeavyHitter` config.
        step: recipe step key for the report.

    Returns:
        The same model.

    Raises:
        IncompatibleModelError: see :meth:`HeavyHitter.check`.

    Example:
        >>> from infopt.models import tiny_model
        >>> m = use_(tiny_model(), HeavyHitter(budget=8, recent=2))
        >>> m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=20, do_sample=False).shape
        torch.Size([1, 23])
    """
    info = inspect_model(model)
    config.check(model, info, (config,))
    key = step or config.key
    if model.config._attn_implementation != "eager":
        set_backend_(model, "eager", step=key)
    for module in _attention_modules(model, info):
        register_hook(model, module, attention_weights_hook, kind="forward", step=key, with_kwargs=True)

    def check(call):
        if model.config._attn_implementation != "eager":
            raise Unsupported(f"attention backend {model.config._attn_implementation} returns no attention weights")

    set_part(model, "cache", FreshCache(model, config, key, padding=False, check=check), step=key)
    return model


@register_transform(HeavyHitter)
def _apply(model: nn.Module, config: HeavyHitter, ctx: ApplyContext) -> None:
    before = model.config._attn_implementation
    use_(model, config)
    info = ctx.info or inspect_model(model)
    per_seq = info.kv_bytes_per_token * config.budget
    ctx.stats.update({"kv_budget_tokens": config.budget, "kv_bytes_per_sequence_max": per_seq})
    if before != "eager" and not any(before in f for f in ctx.fallbacks):
        ctx.fallbacks.append(f"attention backend {before} -> eager (H2O reads the attention weights)")
    switched = "; attention switched to eager" if before != "eager" else ""
    ctx.notes.append(
        f"H2O: {config.recent} recent + {config.budget - config.recent} heavy-hitter tokens per KV head, KV cache "
        f"at most {per_seq / 2**20:.1f} MiB per sequence (+ fp32 scores){switched}"
    )
