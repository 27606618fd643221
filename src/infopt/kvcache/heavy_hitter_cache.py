"""The transformers ``Cache`` behind :class:`~infopt.kvcache.HeavyHitter` (H2O; imported on first use)."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..core.compat import cache_from
from ..core.introspect import text_config
from .api import BatchMappedLayer, CacheBytes, cache_bytes, tensor_bytes

__all__ = ["HeavyHitterCache", "HeavyHitterLayer", "attention_weights_hook"]


class HeavyHitterLayer(BatchMappedLayer, CacheLayerMixin):
    """One layer of a :class:`HeavyHitterCache`.

    Each (sequence, KV head) keeps its own tokens: the ``recent`` newest plus the ``budget - recent``
    older ones with the largest accumulated attention (summed over the queries that saw them and
    over the query heads sharing the KV head). Keys keep the rotation of their true positions, so
    positions stay the true ones (as in H2O); ``get_seq_length`` counts every token seen.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, budget: int, recent: int):
        super().__init__()
        self.budget, self.recent = budget, recent
        self.scores: torch.Tensor | None = None  # [B, H_kv, n] accumulated attention, float32
        self.seen = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[:, :, :0]
        self.values = value_states[:, :, :0]
        self.scores = torch.zeros(key_states.shape[:2] + (0,), dtype=torch.float32, device=self.device)
        self.is_initialized = True

    def num_tokens(self) -> int:
        return 0 if not self.is_initialized else self.keys.shape[-2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append new K/V ``[B, H_kv, q, D]`` and return all held K/V; eviction waits for this step's
        attention weights (:meth:`observe`)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.evict()  # normally a no-op: observe() evicted after the previous step's attention
        b, h, q, _ = key_states.shape
        self.keys = torch.cat((self.keys, key_states), dim=-2)
        self.values = torch.cat((self.values, value_states), dim=-2)
        self.scores = torch.cat((self.scores, self.scores.new_zeros((b, h, q))), dim=-1)
        self.seen += q
        return self.keys, self.values

    def observe(self, attn_weights: torch.Tensor) -> None:
        """Add this step's attention ``[B, H, q, n]`` to the scores, then evict down to ``budget``."""
        b, h_kv, n = self.scores.shape
        if attn_weights.shape[-1] != n:
            raise RuntimeError(f"attention weights cover {attn_weights.shape[-1]} keys, the cache holds {n}")
        w = attn_weights.detach().float().sum(dim=2)  # [B, H, n]: attention each key received
        w = w.view(b, h_kv, -1, n).sum(dim=2)  # GQA: the query heads sharing a KV head
        self.scores += w
        self.evict()

    def evict(self) -> None:
        n = self.num_tokens()
        if n <= self.budget:
            return
        old = n - self.recent
        heavy = self.budget - self.recent
        b, h, _ = self.scores.shape
        recent_idx = torch.arange(old, n, device=self.device).expand(b, h, -1)
        if heavy > 0:
            top = self.scores[..., :old].topk(heavy, dim=-1).indices.sort(dim=-1).values
            idx = torch.cat((top, recent_idx), dim=-1)  # [B, H_kv, budget], in sequence order
        else:
            idx = recent_idx
        self.keys = self.keys.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, self.keys.shape[-1]))
        self.values = self.values.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, self.values.shape[-1]))
        self.scores = self.scores.gather(2, idx)

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # attention sees the n held tokens + the new ones; the offset lines the causal mask up with the
        # query offset (= tokens seen), every held token being in the past
        n = self.num_tokens()
        return n + query_length, self.seen - n

    def get_max_length(self) -> int:
        return self.budget

    def reset(self) -> None:
        self.keys = self.values = self.scores = None
        self.seen = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("HeavyHitterCache cannot crop: evicted tokens cannot be brought back")

    def _map_batch(self, fn) -> None:
        if self.is_initialized:
            self.keys, self.values, self.scores = fn(self.keys), fn(self.values), fn(self.scores)

    def allocated_bytes(self) -> int:
        return tensor_bytes(self.keys, self.values, self.scores)

    def used_bytes(self) -> int:
        return tensor_bytes(self.keys, self.values, self.scores)


class HeavyHitterCache(Cache):
    """H2O KV cache: per KV head, the ``recent`` newest tokens plus the heaviest hitters, ``budget`` in all.

    The scores come from the attention weights, which only the eager backend returns: each attention
    module needs :func:`attention_weights_hook` as a forward hook (:func:`infopt.kvcache.use_` with
    :class:`~infopt.kvcache.HeavyHitter` installs them and switches the model to eager attention).

    Args:
        config: the model's config.
        budget: tokens kept per KV head after each forward.
        recent: newest tokens always kept.

    Example:
        >>> from infopt.models import tiny_model
        >>> from infopt.kvcache import HeavyHitter, use_
        >>> m = use_(tiny_model(), HeavyHitter(budget=8, recent=2))
        >>> cache = HeavyHitterCache(m.config, budget=8, recent=2)
        >>> _ = m(torch.randint(0, 100, (1, 20)), past_key_values=cache)
        >>> cache.layers[0].keys.shape[-2], cache.get_seq_length()
        (8, 20)
    """

    def __init__(self, config, budget: int, recent: int):
        tc = text_config(config, decoder=True)
        super().__init__(layers=[HeavyHitterLayer(budget, recent) for _ in range(tc.num_hidden_layers)])
        self.budget, self.recent = budget, recent

    def memory_bytes(self) -> CacheBytes:
        """Bytes the cache holds now (flat once it reaches ``budget``; scores included in ``used``)."""
        dtype = next((layer.dtype for layer in self.layers if layer.is_initialized), None)
        return cache_bytes(self.layers, dtype)


def attention_weights_hook(module, args, kwargs, output):
    """Forward hook for an attention module: pass its attention weights to a :class:`HeavyHitterCache`.

    Raises:
        RuntimeError: the module returned no weights (a non-eager attention backend).
    """
    cache = cache_from(kwargs)
    if not isinstance(cache, HeavyHitterCache):
        return None
    weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
    if weights is None:
        impl = getattr(getattr(module, "config", None), "_attn_implementation", "?")
        raise RuntimeError(
            f"HeavyHitterCache needs attention weights, but {type(module).__name__} (attention backend '{impl}') "
            "returned none; use the eager backend (kvcache.use_(model, HeavyHitter(...)) switches to it)"
        )
    cache.layers[module.layer_idx].observe(weights)
    return None
