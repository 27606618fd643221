"""Paged KV cache with prefix caching for ``model.generate`` (recipe ``{kvcache: {kind: paged}}``).

K/V live in fixed-size blocks of a pool that persists across ``generate`` calls
(:mod:`infopt.kvcache.paged_cache`); full blocks are indexed by a hash of their prefix
(:mod:`infopt.kvcache.blocks`). A call whose prompt starts like an earlier one (a shared system
prompt) finds those blocks and runs the model only on the rest: the handler builds a cache already
holding the prefix and passes it to the original ``generate`` with the full ``input_ids``;
``generate`` slices off the columns ``cache.get_seq_length()`` reports as cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from ..attention.backends import set_backend_
from ..attention.paged import FLASH_PAGE_MULTIPLE, PAGED_IMPL
from ..core.availability import is_available
from ..core.errors import IncompatibleModelError
from ..core.introspect import ModelInfo, inspect_model, text_config
from ..core.step import ApplyContext, StepConfig, bad_field, register_step, register_transform
from ..generate import CachePart, Unsupported, decoder_for, set_part, tensors_bytes
from .api import register_use, require_full_attention
from .blocks import OutOfBlocks
from .paged_cache import PaddedPagedCache, PagedCache
from .pool import KVBlockPool

__all__ = ["Paged", "PagedPart", "use_paged_", "paged_pool"]


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


@register_step
@dataclass(frozen=True)
class Paged(StepConfig):
    """A paged KV cache: K/V in fixed-size blocks handed out from a pool, with prefix caching across calls.

    ``generate`` calls run on the paged attention backend (``attention: {backend: paged}``); applying
    this step alone switches the backend itself (recorded, so :func:`infopt.undo` switches it back).
    Greedy output is token-identical to plain ``generate``.

    Args:
        block_size: tokens per block. Small blocks waste less of a sequence's last block and share
            prefixes at a finer grain; large ones mean shorter block tables. flash-attn's paged kernel
            (CUDA, fp16/bf16) needs a multiple of 256; other sizes use the torch reference kernel.
        num_blocks: blocks in the pool. None (default): sized from the calls' needs. The pool starts
            empty and grows (at least doubling) when a call needs more blocks than are free or
            evictable, so it ends at about the largest call's size; cached prefixes live in what is
            left and are evicted least recently used first. An int fixes the pool
            (``num_blocks * block_size`` tokens; see
            :func:`~infopt.kvcache.pool.num_blocks_for_budget` for a memory budget); calls that
            do not fit go to the original ``generate``.
        prefix_caching: keep full blocks after a call so later prompts sharing a prefix reuse them.

    Raises:
        RecipeError: a non-positive or non-integer size, a non-bool ``prefix_caching``.

    Example:
        >>> import infopt, torch
        >>> from infopt.models import tiny_model
        >>> m = infopt.optimize(tiny_model(), [Paged(block_size=16)])
        >>> m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False).shape
        torch.Size([1, 7])
    """

    stage: ClassVar[str] = "kvcache"
    kind: ClassVar[str] = "paged"
    discriminator: ClassVar[str] = "kind"
    fidelity: ClassVar[str] = "lossless"  # paged attention sums over blocks in another order
    block_size: int = 16
    num_blocks: int | None = None
    prefix_caching: bool = True

    def __post_init__(self):
        if not _positive_int(self.block_size):
            raise bad_field(self, "block_size", self.block_size, "a positive integer (tokens per block, e.g. 16)")
        if self.num_blocks is not None and not _positive_int(self.num_blocks):
            raise bad_field(self, "num_blocks", self.num_blocks, "a positive integer, or null to size the pool per call")
        if not isinstance(self.prefix_caching, bool):
            raise bad_field(self, "prefix_caching", self.prefix_caching, "true or false")

    def check(self, model: nn.Module, info: ModelInfo, steps) -> list[str]:
        can = getattr(model, "_can_set_attn_implementation", None)
        if callable(can) and not can():
            raise IncompatibleModelError(
                f"{type(model).__name__} does not route attention through transformers' attention interface, "
                "so the paged attention backend cannot read its cache; use kvcache static"
            )
        require_full_attention(model, "kvcache paged", windows=True)  # the paged kernels apply sliding windows
        if getattr(text_config(model.config), "attn_logit_softcapping", None) is not None:
            raise IncompatibleModelError(
                f"{type(model).__name__} soft-caps attention logits, which the paged attention kernels do not "
                "implement; use kvcache static"
            )
        if info.device.type == "cuda" and (self.block_size % FLASH_PAGE_MULTIPLE or not is_available("flash_attn")):
            return [f"paged attention uses the torch reference kernel (gather + SDPA): flash-attn's paged kernel needs "
                    f"flash-attn installed and block_size a multiple of {FLASH_PAGE_MULTIPLE}"]
        return []


class PagedPart(CachePart):
    """The paged-cache part of a model's decoder: the pool every call shares (and so the prefix cache).

    Calls run in transformers' loop on a :class:`~infopt.kvcache.paged_cache.PagedCache` that already holds
    the cached prefix, so ``generate`` runs the model only on the rest of each prompt.
    """

    lean = False  # generate slices off the prefix the cache reports as cached; infopt's loops run the whole prompt

    def __init__(self, model: nn.Module, config: Paged, key: str):
        self.model = model
        self.config = config
        self.key = key
        self.pool = KVBlockPool(inspect_model(model).num_layers, config.num_blocks or 0, config.block_size,
                                prefix_caching=config.prefix_caching, growable=config.num_blocks is None)
        self._caches: dict[int, PagedCache] = {}  # per open call (calls may come from several threads)

    def resident(self, seen: set) -> dict[str, int]:
        n = tensors_bytes([*self.pool.keys, *self.pool.values], seen)
        return {"paged KV pool": n} if n else {}

    def open(self, call, slots=None):
        model = self.model
        gc = call.generation_config
        if (getattr(gc, "num_return_sequences", 1) or 1) != 1:
            raise Unsupported("num_return_sequences > 1")
        if model.config._attn_implementation != PAGED_IMPL:
            raise Unsupported(f"attention backend is {model.config._attn_implementation}, not paged")
        if call.left_pads is None:
            raise Unsupported("attention_mask is not left padding (or pad tokens without an attention_mask)")
        ids = call.input_ids
        rows = [ids[b, p:].tolist() for b, p in enumerate(call.left_pads)]
        cache = PaddedPagedCache(self.pool, config=model.config)
        try:
            cache.start_padded(rows, list(call.left_pads), call.max_new_tokens)
        except OutOfBlocks as e:
            raise Unsupported(f"pool too small: {e}") from None
        self._caches[id(call)] = cache
        return cache

    def close(self, call, out):
        cache = self._caches.pop(id(call), None)
        if cache is not None:
            cache.finish_padded(out)


def paged_pool(model: nn.Module) -> KVBlockPool | None:
    """The :class:`~infopt.kvcache.pool.KVBlockPool` a model's ``generate`` calls use, or None.

    Example:
        >>> import torch
        >>> from infopt.models import tiny_model
        >>> m = use_paged_(tiny_model(), Paged())
        >>> _ = m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
        >>> paged_pool(m).allocator.num_used  # every block released when the call ended
        0
    """
    dec = decoder_for(model)
    part = dec.cache if dec is not None else None
    return part.pool if isinstance(part, PagedPart) else None


@register_use(Paged)
def use_paged_(model: nn.Module, config: Paged | None = None, *, step: str | None = None) -> nn.Module:
    """Make ``model.generate`` (and pipelines) decode with a paged KV cache and prefix caching, in place.

    Switches the attention backend to ``paged`` when it is not already (recorded for undo). Calls the
    paged cache cannot serve (beam search, several return sequences, assisted decoding, a
    caller-supplied cache, right padding, a fixed pool too small) go to the original ``generate``;
    :func:`infopt.generate.routing_stats` counts them.

    Args:
        model: a transformers causal LM with full causal attention.
        config: the :class:`Paged` settings (default ``Paged()``).

    Returns:
        The same model.

    Raises:
        IncompatibleModelError: see :meth:`Paged.check`.
    """
    config = config or Paged()
    info = inspect_model(model)
    config.check(model, info, (config,))
    key = step or config.key
    if model.config._attn_implementation != PAGED_IMPL:
        set_backend_(model, "paged", step=key)
    set_part(model, "cache", PagedPart(model, config, key), step=key)
    return model


@register_transform(Paged)
def _apply(model: nn.Module, config: Paged, ctx: ApplyContext) -> None:
    before = model.config._attn_implementation
    use_paged_(model, config)
    info = ctx.info or inspect_model(model)
    block_mib = info.kv_bytes_per_token * config.block_size / 2**20
    size = (f"{config.num_blocks} blocks ({config.num_blocks * block_mib:.1f} MiB)" if config.num_blocks
            else "a pool sized by the largest call")
    ctx.notes.append(
        f"paged KV cache: {config.block_size}-token blocks ({block_mib:.2f} MiB each), {size}, prefix caching "
        f"{'on' if config.prefix_caching else 'off'}"
    )
    if before != PAGED_IMPL:
        ctx.notes.append(f"attention backend switched {before} -> paged (kvcache paged needs it; undo restores it)")
