"""Static (preallocated, fixed-shape) KV cache, reused across ``generate`` calls."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import nn
from transformers import StaticCache
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

from ..attention.gqa import GQA_SDPA_IMPL
from ..core.errors import IncompatibleModelError
from ..core.introspect import context_length, inspect_model
from ..core.step import ApplyContext, StepConfig, bad_field, register_step, register_transform
from ..generate import CachePart, Unsupported, decoder_for, set_part, tensors_bytes
from .api import register_use

__all__ = ["Static", "StaticCaches", "StaticAllocation", "use_", "bucket_length", "static_max_length",
           "full_length_static_cache", "SizedStaticLayer"]


@register_step
@dataclass(frozen=True)
class Static(StepConfig):
    """A preallocated KV cache of static shape ``[batch, kv_heads, L, head_dim]`` per layer, where ``L`` is the
    call's length rounded up to a 256-token bucket (at most ``max_length``).

    Static shapes are what ``torch.compile`` needs, and reusing one allocation across calls avoids
    growing (and copying) the cache token by token.

    Args:
        max_length: longest call served, in tokens (prompt + new tokens); longer calls go to the
            original ``generate`` and the report counts them. None: the model's context length,
            capped at 32768. Each call gets a cache of its own length rounded up to a multiple of
            256 (see :func:`bucket_length`), reused while calls fit the same bucket.
        batch_size: fixed batch size, or None to size the cache on each call's batch.
        dtype: ``"float16"`` or ``"bfloat16"`` to store keys and values in 16 bits while the model computes in its
            own dtype (half the cache's bytes for an fp32 model, and half of what a decode step reads from it); None
            (default): the model's dtype. Lossy: each key and value is rounded once, when it is written (fp16
            keeps 11 significant bits, bf16 8; fp16 saturates at +-65504). On CPU, infopt's attention kernel reads
            the 16-bit cache in place, converting in registers; other attention backends read a copy in the
            model's dtype. The step's ``fidelity`` is ``lossy`` with a dtype, ``lossless`` without.

    Raises:
        RecipeError: non-positive max_length or batch_size, or a dtype other than float16 / bfloat16.

    Example:
        >>> import infopt, torch
        >>> from infopt.models import tiny_model
        >>> m = infopt.optimize(tiny_model(), [Static(max_length=64)])
        >>> m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False).shape
        torch.Size([1, 7])
    """

    stage: ClassVar[str] = "kvcache"
    kind: ClassVar[str] = "static"
    discriminator: ClassVar[str] = "kind"
    fidelity: ClassVar[str] = "lossless"  # attention over a fixed-length masked cache: another kernel shape
    max_length: int | None = None
    batch_size: int | None = None
    dtype: str | None = None

    def __post_init__(self):
        if self.dtype is not None:
            if self.dtype not in CACHE_DTYPES:
                raise bad_field(self, "dtype", self.dtype, f"one of {', '.join(CACHE_DTYPES)}, or null for the "
                                "model's own dtype")
            object.__setattr__(self, "fidelity", "lossy")  # each key and value rounded to 16 bits when written
        if self.max_length is not None and (
            not isinstance(self.max_length, int) or isinstance(self.max_length, bool) or self.max_length <= 0
        ):
            raise bad_field(self, "max_length", self.max_length, "a positive integer (prompt + new tokens)")
        if self.batch_size is not None and (not isinstance(self.batch_size, int) or self.batch_size <= 0):
            raise bad_field(self, "batch_size", self.batch_size, "a positive integer or null")

    def check(self, model, info, steps):
        limit = context_length(model)
        if limit is not None and self.max_length is not None and self.max_length > limit:
            raise IncompatibleModelError(
                f"kvcache.Static(max_length={self.max_length}) exceeds the model's {limit} positions; "
                f"use max_length <= {limit}"
            )
        return []


CACHE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
"""The dtypes :class:`Static` stores keys and values in when asked to (its ``dtype``), by name."""

FP16_MAX = 65504.0

DEFAULT_CAP = 32768
"""The longest call a static cache serves by default (a model with a longer context is capped here): calls are served
on caches of their own 256-token bucket, so a long cap costs memory only when a call is that long (4096 before:
a longer prompt went to transformers' own loop)."""


def resolved_max_length(model: nn.Module, config: Static) -> int:
    """``config.max_length``, or the model's context length capped at :data:`DEFAULT_CAP`."""
    if config.max_length is not None:
        return config.max_length
    return min(int(context_length(model) or DEFAULT_CAP), DEFAULT_CAP)


BUCKET = 256


def bucket_length(needed: int, max_length: int, bucket: int = BUCKET) -> int:
    """Cache length for a call needing ``needed`` positions: ``needed`` rounded up to a multiple of
    ``bucket``, at most ``max_length``.

    transformers' static cache attends over its whole length at every decode step, so a cache far
    longer than the call wastes time (default model, 48 new tokens, quiet 2-core CPU: 17.1 tok/s
    at 128 slots, 15.4 at 2,048, 13.3 at 4,096; ``benchmarks/studies/static_cache_length.py``). Buckets keep
    shapes static (few distinct shapes for ``torch.compile``) without that waste.

    Example:
        >>> bucket_length(40, 2048), bucket_length(300, 2048), bucket_length(2000, 2048)
        (256, 512, 2048)
    """
    return min(max_length, -(-needed // bucket) * bucket)


class SizedStaticLayer(StaticLayer):
    """transformers' full-attention ``StaticLayer`` whose length is read from its tensors' shape once they exist.

    transformers' layer keeps its length as a Python int (``max_cache_len``) and reports it as the attention mask's
    key length, so a compiled decode step bakes the cache length into its graph as a constant (dynamo guards on it,
    ``torch.export`` specializes on it): each 256-token cache bucket then needs a graph of its own, compiled inside
    whichever call first reaches it. Here ``max_cache_len`` is ``keys.shape[-2]`` once the keys are allocated, a size
    a compiled step can keep symbolic, so one graph serves every cache length
    (:class:`~infopt.compile.decoder.CompiledForward`); wherever the model reads the length, it reads that size.
    Everything else is the parent's.

    Example:
        >>> import torch
        >>> layer = SizedStaticLayer(max_cache_len=512)
        >>> _ = layer.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))
        >>> layer.get_mask_sizes(1), layer.keys.shape[-2]
        ((512, 0), 512)
    """

    def __init__(self, max_cache_len: int, dtype: torch.dtype | None = None, upcast: bool = True):
        super().__init__(max_cache_len=max_cache_len)
        self.store_dtype = dtype
        self.upcast = upcast

    @property
    def max_cache_len(self):
        keys = self.__dict__.get("keys")
        return self._length if keys is None else keys.shape[-2]

    @max_cache_len.setter
    def max_cache_len(self, value: int) -> None:
        self._length = value

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """The parent's update; with a ``store_dtype`` other than the states', they are rounded to it as they are
        written (fp16 saturating at +-65504), and the whole cache is returned in that dtype to an attention that
        reads it so (``upcast=False``: infopt's GQA backend), else as a copy in the states' dtype."""
        dtype = self.store_dtype
        if dtype is None or key_states.dtype == dtype:
            return super().update(key_states, value_states, *args, **kwargs)
        keys, values = super().update(_narrow(key_states, dtype), _narrow(value_states, dtype), *args, **kwargs)
        if self.upcast:
            return keys.to(key_states.dtype), values.to(value_states.dtype)
        return keys, values


def _narrow(states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float16:
        states = states.clamp(-FP16_MAX, FP16_MAX)
    return states.to(dtype)


def full_length_static_cache(config, length: int, dtype: torch.dtype | None = None, upcast: bool = True):
    """transformers' ``StaticCache`` of ``length`` slots whose layers are all full-length :class:`SizedStaticLayer`.

    transformers' sliding-window static layer keeps only the window, in a buffer it rolls through Python-int
    control flow (``cumulative_length_int``): a compiled decode step guards on that int and recompiles every token
    (Gemma 3, Mistral with a window), and a rolled buffer cannot take rejected draft tokens back. Here every layer
    holds all ``length`` slots at fixed addresses; the model's sliding-window mask (over cache slots, as transformers
    builds it for any layer) keeps each query to its window, so the attention result is the same. The price is the
    slots past the window: ``length`` is the call's 256-token bucket, not the model's context (Gemma 3 270M: 2 KiB
    per token per sliding layer in fp32). Every layer reports its mask width from its tensors' shape
    (:class:`SizedStaticLayer`), so one compiled step serves every length. With ``dtype``, the layers store keys and
    values in it, returned to the attention as copies in the model's dtype unless ``upcast`` is False.

    Example:
        >>> from infopt.models import tiny_model
        >>> cache = full_length_static_cache(tiny_model("gemma3").config, 256)
        >>> [type(layer).__name__ for layer in cache.layers], cache.get_max_length()
        (['SizedStaticLayer', 'SizedStaticLayer'], 256)
    """
    cache = StaticCache(config=config, max_cache_len=length)
    cache.layers = [SizedStaticLayer(max_cache_len=length, dtype=dtype, upcast=upcast)
                    if type(layer) in (StaticLayer, StaticSlidingWindowLayer) else layer for layer in cache.layers]
    return cache


class StaticAllocation(NamedTuple):
    """The static cache a model holds now, and what it was allocated for (:meth:`StaticCaches.allocation`).

    A new allocation replaces it when a call differs in any field but ``cache``.

    Attributes:
        batch: rows of the cache (the call's batch, or the config's fixed ``batch_size``).
        length: slots per layer: the call's length rounded up to a 256-token bucket, at most ``max_length``.
        autocast: ``(device type, enabled, dtype or None)``: the ``torch.autocast`` state of the calls it serves.
        dtype: the model's dtype when it was allocated.
        device: the model's device when it was allocated.
        cache: the ``transformers.StaticCache`` itself (its layers hold ``[batch, kv_heads, length, head_dim]``).
    """

    batch: int
    length: int
    autocast: tuple
    dtype: torch.dtype | None
    device: torch.device | None
    cache: object


class StaticCaches(CachePart):
    """The static-cache part of a model's decoder: one allocation per model (the target, and a speculative draft
    beside it), handed out reset per call and reallocated on a new batch size or length bucket."""

    def __init__(self, model: nn.Module, config: Static, key: str):
        self.model = model
        self.config = config
        self.key = key
        self.max_length = resolved_max_length(model, config)
        # model -> (key, cache), key = the first five fields of StaticAllocation
        self._held: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, object]] = weakref.WeakKeyDictionary()

    def allocation(self, model: nn.Module | None = None) -> StaticAllocation | None:
        """The static cache ``model`` holds now and what it was allocated for, or None before its first call.

        Args:
            model: the target model (default) or a speculative draft model that shares this part.

        Returns:
            A :class:`StaticAllocation`, or None when no call has allocated one yet.

        Example:
            >>> import infopt, torch
            >>> from infopt.generate import decoder_for
            >>> from infopt.models import tiny_model
            >>> m = infopt.optimize(tiny_model(), [Static(max_length=512)])
            >>> _ = m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
            >>> a = decoder_for(m).cache.allocation()
            >>> a.batch, a.length, a.device.type
            (1, 256, 'cpu')
        """
        held = self._held.get(self.model if model is None else model)
        return None if held is None else StaticAllocation(*held[0], held[1])

    def _get(self, model: nn.Module, batch: int, needed: int):
        # transformers' static layers take their dtype from the first keys written: a call under torch.autocast
        # writes other dtypes than one without, so each autocast state gets its own allocation (as a fresh cache per
        # call would), instead of a failing index_copy_ into the other call's tensors; so does a model moved or cast
        # since (model.to(torch.bfloat16), .cuda())
        key = (batch, bucket_length(min(needed, self.max_length), self.max_length), _autocast_state(model),
               getattr(model, "dtype", None), getattr(model, "device", None))
        # infopt's GQA backend reads a 16-bit cache as it is; any other attention gets copies in the model's dtype
        # (decided per call: the attention a model runs can change between calls, by undo or set_backend_)
        upcast = getattr(model.config, "_attn_implementation", None) != GQA_SDPA_IMPL
        held = self._held.get(model)
        if held is not None and held[0] == key:
            held[1].reset()
            for layer in held[1].layers:
                if isinstance(layer, SizedStaticLayer):
                    layer.upcast = upcast
            return held[1]
        self._held.pop(model, None)  # free the old allocation first
        cache = full_length_static_cache(model.config, key[1], dtype=CACHE_DTYPES.get(self.config.dtype), upcast=upcast)
        self._held[model] = (key, cache)
        return cache

    def open(self, call, slots=None):
        total = call.total_length
        if total > self.max_length:
            raise Unsupported(f"length {total} > max_length {self.max_length}")
        if self.config.batch_size is not None and call.batch != self.config.batch_size:
            raise Unsupported(f"batch {call.batch} != batch_size {self.config.batch_size}")
        return self._get(self.model, call.batch, max(total, slots or 0))

    def cache_for(self, model, batch, slots):
        return self._get(model, batch, slots)

    def resident(self, seen: set) -> dict[str, int]:
        tensors = [t for _, cache in list(self._held.values()) for layer in getattr(cache, "layers", ())
                   for t in vars(layer).values() if isinstance(t, torch.Tensor)]
        n = tensors_bytes(tensors, seen)
        return {"static KV cache (kept for the next call)": n} if n else {}


def _autocast_state(model: nn.Module) -> tuple:
    device = getattr(model, "device", None)
    kind = device.type if isinstance(device, torch.device) else "cpu"
    try:
        on = torch.is_autocast_enabled(kind)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return (kind, False, None)
    return (kind, on, torch.get_autocast_dtype(kind) if on else None)


def static_max_length(model: nn.Module) -> int | None:
    """The longest call (prompt + new tokens) ``model``'s static cache serves, or None without one."""
    dec = decoder_for(model)
    part = dec.cache if dec is not None else None
    return part.max_length if isinstance(part, StaticCaches) else None


@register_use(Static)
def use_(model: nn.Module, config: Static, *, step: str | None = None) -> nn.Module:
    """Make ``model.generate`` (and pipelines) decode with a static cache, in place.

    Calls the static cache cannot serve (beam search, a caller-supplied ``past_key_values``, a
    length over ``max_length``, a batch size other than a fixed ``batch_size``) go to the original
    ``generate``; :func:`infopt.generate.routing_stats` counts them. Calls infopt's loops do not serve
    (logits processors, penalties) run in transformers' loop on the static cache.

    Returns:
        The same model.
    """
    inspect_model(model)  # refuses unsupported architectures
    key = step or config.key
    set_part(model, "cache", StaticCaches(model, config, key), step=key)
    return model


@register_transform(Static)
def _apply(model: nn.Module, config: Static, ctx: ApplyContext) -> None:
    use_(model, config)
    info = ctx.info or inspect_model(model)
    length = resolved_max_length(model, config)
    per_seq, stored = info.kv_bytes_per_token * length, ""
    if config.dtype is not None:
        per_seq = 2 * info.num_layers * info.num_kv_heads * info.head_dim * CACHE_DTYPES[config.dtype].itemsize * length
        stored = f", keys and values stored in {config.dtype}"
    ctx.notes.append(
        f"static KV cache up to {length} tokens ({per_seq / 2**20:.1f} MiB per sequence at most{stored}), sized per "
        f"call in {BUCKET}-token buckets and reused"
    )
