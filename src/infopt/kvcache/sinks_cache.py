"""The transformers ``Cache`` behind :class:`~infopt.kvcache.Sinks` (StreamingLLM; imported on first use)."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..core.compat import cache_from
from ..core.introspect import text_config
from .api import BatchMappedLayer, CacheBytes, cache_bytes, tensor_bytes

__all__ = ["SinkCache", "SinkLayer", "rerotate", "rope_inv_freq", "position_hook"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rerotate(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Move rope-rotated keys by ``delta`` positions: a key rotated at ``p`` comes out rotated at ``p + delta``.

    RoPE rotates each pair of channels ``(i, i + r/2)`` by ``p * inv_freq[i]``; rotations compose, so
    rotating by ``delta * inv_freq`` moves a key from ``p`` to ``p + delta``. The model's
    ``attention_scaling`` (YaRN) is already in the key and is not applied again. With partial rotary
    embeddings (``r = 2 * len(inv_freq) < D``) the channels past ``r`` are left alone.

    Args:
        keys: ``[..., n, D]`` keys, rotated as the model's attention rotated them.
        delta: ``[n]`` position shift per key (0 leaves a key bit-identical).
        inv_freq: ``[r / 2]`` the model's rotary inverse frequencies.

    Returns:
        The rotated keys, same shape and dtype.

    Example:
        >>> inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
        >>> k = torch.randn(1, 1, 3, 8)
        >>> torch.allclose(rerotate(rerotate(k, torch.tensor([5, 0, -2]), inv), torch.tensor([-5, 0, 2]), inv), k, atol=1e-5)
        True
    """
    r = 2 * inv_freq.numel()
    angle = delta.to(device=keys.device, dtype=torch.float32)[:, None] * inv_freq.to(keys.device, torch.float32)
    emb = torch.cat((angle, angle), dim=-1)  # [n, r]
    k = keys[..., :r].float()
    out = (k * emb.cos() + _rotate_half(k) * emb.sin()).to(keys.dtype)
    return out if r == keys.shape[-1] else torch.cat((out, keys[..., r:]), dim=-1)


def rope_inv_freq(model) -> tuple[torch.Tensor, str]:
    """The model's rotary ``inv_freq`` buffer and its ``rope_type``.

    Raises:
        ValueError: no rotary embedding (learned positions, GPT-2), or several with different frequencies.
    """
    found = [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    if not found:
        raise ValueError(f"{type(model).__name__} has no rotary position embedding (a module with `inv_freq`)")
    first = found[0].inv_freq
    for m in found[1:]:
        if m.inv_freq.shape != first.shape or not torch.equal(m.inv_freq.to(first.device), first):
            raise ValueError(f"{type(model).__name__} has rotary embeddings with different frequencies per layer")
    return first, str(getattr(found[0], "rope_type", "default"))


class SinkLayer(BatchMappedLayer, CacheLayerMixin):
    """One layer of a :class:`SinkCache`: ``num_sink_tokens`` first tokens + the most recent ones, at most ``window``.

    Keys are stored as the model rotated them (at the in-cache slot they were written to), with that
    position in ``rot_pos``; a returned key is rotated from there to its current slot in one step
    (:func:`rerotate`), so rounding errors do not build up as tokens slide, and keys that never moved
    come back bit-identical.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, window: int, num_sink_tokens: int, inv_freq: torch.Tensor):
        super().__init__()
        self.window, self.num_sink_tokens, self.inv_freq = window, num_sink_tokens, inv_freq
        self.rot_pos: torch.Tensor | None = None  # [n] position each stored key is rotated at
        self.seen = 0
        self.shifted = False  # some stored key sits at a slot other than the one it was rotated at

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[:, :, :0]
        self.values = value_states[:, :, :0]
        self.rot_pos = torch.zeros(0, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def num_tokens(self) -> int:
        return 0 if not self.is_initialized else self.keys.shape[-2]

    def kept_before(self, q: int) -> int:
        """Tokens kept from the cache when ``q`` new ones arrive, so that attention sees at most ``window``."""
        c, s = self.num_tokens(), self.num_sink_tokens
        if c + q <= self.window:
            return c
        return max(min(c, s), self.window - q)

    def _keep(self, keep: int) -> None:
        # keep the sinks and the newest `keep - sinks` tokens; slots after the sinks move left
        c = self.num_tokens()
        if keep >= c:
            return
        s = min(c, self.num_sink_tokens)
        idx = torch.cat((torch.arange(s, device=self.device), torch.arange(c - (keep - s), c, device=self.device)))
        self.keys = self.keys.index_select(2, idx)
        self.values = self.values.index_select(2, idx)
        self.rot_pos = self.rot_pos.index_select(0, idx)
        self.shifted = True

    def make_room(self, q: int) -> int:
        """Evict so ``q`` new tokens fit; return the in-cache position of the first of them."""
        if self.is_initialized:
            self._keep(self.kept_before(q))
        return self.num_tokens()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append new K/V ``[B, H_kv, q, D]`` (rotated at in-cache positions ``n .. n+q-1``); return the
        cache's K/V with every key rotated to its slot.

        Raises:
            RuntimeError: the tokens do not fit; room must be made first (:meth:`SinkCache.make_room`,
                which the hook :func:`infopt.kvcache.use_` installs calls before each forward).
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        c, q = self.num_tokens(), key_states.shape[-2]
        if self.kept_before(q) < c:
            raise RuntimeError(
                f"SinkCache layer holds {c} tokens and got {q} more (window {self.window}): call "
                "cache.make_room(num_new_tokens) and pass position_ids=cache.position_ids(...) before the forward "
                "(kvcache.use_(model, Sinks(...)) installs a hook that does both)"
            )
        self.keys = torch.cat((self.keys, key_states), dim=-2)
        self.values = torch.cat((self.values, value_states), dim=-2)
        self.rot_pos = torch.cat((self.rot_pos, torch.arange(c, c + q, device=self.device)))
        self.seen += q
        keys = self.keys
        if self.shifted:
            delta = torch.arange(keys.shape[-2], device=self.device) - self.rot_pos
            keys = rerotate(keys, delta, self.inv_freq)
        values = self.values
        if self.num_tokens() > self.window:  # a prompt longer than the window attended in full; keep the window
            self._keep(self.window)
        return keys, values

    def get_seq_length(self) -> int:
        return self.num_tokens()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.num_tokens() + query_length, 0

    def get_max_length(self) -> int:
        return self.window

    def reset(self) -> None:
        self.keys = self.values = self.rot_pos = None
        self.seen = 0
        self.shifted = False
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens; only before any token was evicted."""
        if tokens_to_remove > 0 or self.shifted:
            raise ValueError("SinkCache can only crop (a negative count) before it evicts any token")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        k = -tokens_to_remove
        self.keys, self.values = self.keys[:, :, :-k], self.values[:, :, :-k]
        self.rot_pos = self.rot_pos[:-k]
        self.seen -= k

    def _map_batch(self, fn) -> None:
        if self.is_initialized:
            self.keys, self.values = fn(self.keys), fn(self.values)

    def allocated_bytes(self) -> int:
        return tensor_bytes(self.keys, self.values, self.rot_pos)

    def used_bytes(self) -> int:
        return tensor_bytes(self.keys, self.values)


class SinkCache(Cache):
    """StreamingLLM KV cache: the first ``num_sink_tokens`` tokens ("attention sinks") and the most recent
    ones, ``window`` in all; positions are in-cache positions, so they never exceed ``window``.

    Before each forward, :meth:`make_room` evicts the oldest non-sink tokens so the new ones fit, and
    the new tokens must get ``position_ids`` :meth:`position_ids` (the in-cache positions after
    eviction). :func:`infopt.kvcache.use_` with :class:`~infopt.kvcache.Sinks` installs a forward
    pre-hook doing both, for ``generate`` and direct forward calls. Needs a rotary-embedding model whose
    layers are all full attention, and unpadded batches.

    Args:
        config: the model's config.
        window: tokens kept, sinks included.
        num_sink_tokens: first tokens always kept.
        inv_freq: the model's rotary inverse frequencies (:func:`rope_inv_freq`).

    Example:
        >>> from infopt.models import tiny_model
        >>> m = tiny_model()
        >>> cache = SinkCache(m.config, window=8, num_sink_tokens=2, inv_freq=rope_inv_freq(m)[0])
        >>> for _ in range(3):
        ...     start = cache.make_room(4)
        ...     _ = m(torch.randint(0, 100, (1, 4)), past_key_values=cache, position_ids=cache.position_ids(4))
        >>> cache.get_seq_length(), cache.seen_tokens
        (8, 12)
    """

    def __init__(self, config, window: int, num_sink_tokens: int, inv_freq: torch.Tensor):
        tc = text_config(config, decoder=True)
        super().__init__(layers=[SinkLayer(window, num_sink_tokens, inv_freq) for _ in range(tc.num_hidden_layers)])
        self.window, self.num_sink_tokens = window, num_sink_tokens
        self._next_start = 0

    @property
    def seen_tokens(self) -> int:
        """Tokens that went through the cache (evicted ones included)."""
        return max((layer.seen for layer in self.layers), default=0)

    def make_room(self, num_new_tokens: int) -> int:
        """Evict in every layer so ``num_new_tokens`` fit in ``window``; return the first new in-cache position."""
        starts = {layer.make_room(num_new_tokens) for layer in self.layers}
        if len(starts) != 1:
            raise RuntimeError(f"SinkCache layers disagree on their length ({sorted(starts)}); reset the cache")
        self._next_start = starts.pop()
        return self._next_start

    def position_ids(self, num_new_tokens: int, batch_size: int = 1, device=None) -> torch.Tensor:
        """``[batch_size, num_new_tokens]`` in-cache positions of the next tokens (call :meth:`make_room` first)."""
        pos = torch.arange(self._next_start, self._next_start + num_new_tokens, device=device)
        return pos.unsqueeze(0).expand(batch_size, -1)

    def memory_bytes(self) -> CacheBytes:
        """Bytes the cache holds now (flat once it reaches ``window``), against a dense cache of the same tokens."""
        dtype = next((layer.dtype for layer in self.layers if layer.is_initialized), None)
        return cache_bytes(self.layers, dtype)


def position_hook(module, args, kwargs):
    """Forward pre-hook for a causal LM: with a :class:`SinkCache` in ``past_key_values``, make room for the
    call's tokens and give them in-cache ``position_ids`` (whatever ``generate`` computed)."""
    cache = cache_from(kwargs)
    if not isinstance(cache, SinkCache):
        return None
    x = kwargs.get("input_ids", args[0] if args else None)
    if x is None:
        x = kwargs.get("inputs_embeds")
    batch, q = x.shape[0], x.shape[1]
    cache.make_room(q)
    kwargs["position_ids"] = cache.position_ids(q, batch, device=x.device)
    return args, kwargs
