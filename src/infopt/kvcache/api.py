"""One verb for every KV cache kind, ``use_(model, config)``, plus the checks and accounting the kinds share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import get_layer_types_and_kwargs

from ..core.errors import IncompatibleModelError, RecipeError
from ..core.introspect import text_config
from ..core.step import StepConfig
from ..generate import CachePart, Unsupported

__all__ = ["use_", "register_use", "USE_FUNCTIONS", "CacheBytes", "cache_bytes", "FreshCache",
           "require_full_attention"]

# config class -> use_(model, config, *, step=None); filled by @register_use beside each kind
USE_FUNCTIONS: dict[type[StepConfig], Callable[..., nn.Module]] = {}


def register_use(config_cls: type[StepConfig]):
    """Decorator registering ``fn(model, config, *, step=None)`` as the :func:`use_` of ``config_cls``."""

    def deco(fn):
        USE_FUNCTIONS[config_cls] = fn
        return fn

    return deco


def use_(model: nn.Module, config: StepConfig, *, step: str | None = None) -> nn.Module:
    """Make ``model.generate`` (and pipelines) decode with the KV cache ``config`` describes, in place.

    Dispatches on the config type: :class:`~infopt.kvcache.Static`, :class:`~infopt.kvcache.Quantized`,
    :class:`~infopt.kvcache.Sinks`, :class:`~infopt.kvcache.HeavyHitter`, :class:`~infopt.kvcache.Paged`.
    Calls a cache cannot serve (beam search, say) go to the original ``generate``; :func:`infopt.generate.routing_stats`
    counts them and gives the reasons. :func:`infopt.undo` restores the original ``generate``.

    Args:
        model: a transformers causal LM.
        config: a kvcache step config.
        step: recipe step key for the report (default: ``config.key``).

    Returns:
        The same model.

    Raises:
        RecipeError: ``config`` is not a kvcache config.
        IncompatibleModelError: the model does not support this cache (see each config's ``check``).

    Example:
        >>> from infopt.models import tiny_model
        >>> from infopt.kvcache import Quantized
        >>> m = use_(tiny_model(hidden_size=128, num_heads=2, num_kv_heads=1), Quantized(bits=4))
        >>> m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False).shape
        torch.Size([1, 7])
    """
    fn = USE_FUNCTIONS.get(type(config))
    if fn is None:
        kinds = ", ".join(sorted(c.__name__ for c in USE_FUNCTIONS))
        raise RecipeError(f"kvcache.use_ takes a kvcache config ({kinds}); got {type(config).__name__}: {config!r}")
    return fn(model, config, step=step)


class FreshCache(CachePart):
    """A cache part that builds a new cache per call with ``config.new_cache(model)`` (quantized, sinks,
    heavy-hitter).

    Args:
        model: the model.
        config: the kvcache step config.
        key: the recipe step key.
        padding: serve left-padded batches (an evicting cache keeps no padding map, so it refuses them).
        check: ``check(call)`` raising :class:`~infopt.generate.Unsupported` for calls it cannot serve.
    """

    def __init__(self, model: nn.Module, config: StepConfig, key: str, *, padding: bool = True,
                 check: Callable[[Any], None] | None = None):
        self.model, self.config, self.key, self.padding, self.check = model, config, key, padding, check

    def open(self, call, slots=None):
        if not self.padding and call.padded:
            raise Unsupported("padded batch (attention_mask holds zeros); an evicting cache keeps no padding map")
        if self.check is not None:
            self.check(call)
        return self.config.new_cache(self.model)


def require_full_attention(model: nn.Module, what: str, *, windows: bool = False) -> None:
    """Raise :class:`IncompatibleModelError` unless every layer of ``model`` is full (global) attention.

    The infopt caches replace whole layers of transformers' cache; a model with sliding-window or
    chunked layers (Gemma 3, Mistral with ``sliding_window``) needs per-layer-type caches they do not build.

    Args:
        windows: also accept sliding-window and chunked layers, for a cache that keeps every token in every layer
            (the model's mask then keeps each query to its window, as transformers builds it over cache slots).
    """
    tc = text_config(model.config, decoder=True)
    types, _ = get_layer_types_and_kwargs(tc)  # how transformers' own caches read the layer structure
    allowed = ("full_attention", "sliding_attention", "chunked_attention") if windows else ("full_attention",)
    other = sorted({t for t in types if t not in allowed})
    if other:
        raise IncompatibleModelError(
            f"{what} supports models whose layers are all full attention; {type(model).__name__} has "
            f"{', '.join(other)} layers. Use kvcache.Static (or no kvcache step) for this model"
        )


@dataclass(frozen=True)
class CacheBytes:
    """Bytes a KV cache holds, against a dense cache of the same tokens.

    Attributes:
        tokens: tokens held per sequence (the quantized and full-precision parts together; for an
            evicting cache, what it keeps, not what it has seen).
        allocated: bytes of every tensor the cache owns, spare capacity included.
        used: bytes holding live tokens (and their scales and zero-points).
        dense: bytes a plain cache of the model's dtype would use for ``tokens``.
        dense_fp32: the same in float32; ``dense_fp16``: in float16.
    """

    tokens: int
    allocated: int
    used: int
    dense: int
    dense_fp32: int
    dense_fp16: int

    @property
    def ratio_fp32(self) -> float:
        """``used / dense_fp32`` (0.0 for an empty cache)."""
        return self.used / self.dense_fp32 if self.dense_fp32 else 0.0

    @property
    def saved(self) -> int:
        """Bytes saved against a dense cache of the model's dtype (``dense - used``)."""
        return self.dense - self.used


def cache_bytes(layers, dtype: torch.dtype | None) -> CacheBytes:
    """Sum :class:`CacheBytes` over cache layers that define ``allocated_bytes``, ``used_bytes``,
    ``num_tokens`` and ``kv_elements`` (elements one token costs in K and V together)."""
    tokens = allocated = used = elems = 0
    for layer in layers:
        if not getattr(layer, "is_initialized", False):
            continue
        allocated += layer.allocated_bytes()
        used += layer.used_bytes()
        elems += layer.kv_elements() * layer.num_tokens()
        tokens = max(tokens, layer.num_tokens())
    size = torch.finfo(dtype).bits // 8 if dtype is not None and dtype.is_floating_point else 4
    return CacheBytes(tokens=tokens, allocated=allocated, used=used, dense=elems * size, dense_fp32=elems * 4,
                      dense_fp16=elems * 2)


class BatchMappedLayer:
    """Mixin for cache layers: beam reordering and batch selection/repetition, expressed once through the
    layer's ``_map_batch(fn)`` (which applies ``fn`` to every per-batch tensor it holds), and the KV
    elements per token of its ``keys``/``values``."""

    def _map_batch(self, fn) -> None:
        raise NotImplementedError

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def kv_elements(self) -> int:
        b, h, _, d = self.keys.shape
        return b * h * (d + self.values.shape[-1])


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes of the given tensors' elements (None counts 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
