"""Paged KV storage: one K and one V block pool per layer, handed out by a :class:`BlockAllocator`.

Each layer owns a K and a V pool of shape ``[num_blocks, block_size, kv_heads, head_dim]``
(token-major inside a block). Writing a step's new tokens is then one ``index_copy_`` of
``[n, kv_heads, head_dim]`` rows into the flattened ``[num_blocks * block_size, kv_heads, head_dim]``
view, gathering a sequence is one row gather, and it is the layout flash-attn's paged kernels read,
so the same pools serve the reference and the fused kernel without a copy.

A pool outlives the caches built on it, so prefix-cached blocks are reused across ``generate`` calls.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.introspect import inspect_model
from .blocks import BlockAllocator, OutOfBlocks

__all__ = ["KVBlockPool", "num_blocks_for_budget"]


def num_blocks_for_budget(model: nn.Module, budget_bytes: int, block_size: int = 16) -> int:
    """How many blocks of ``block_size`` tokens fit in ``budget_bytes`` of KV memory (K and V, all layers,
    at the model's dtype): the way a serving engine sizes its pool.

    Example:
        >>> from infopt.models import tiny_model
        >>> num_blocks_for_budget(tiny_model(), 2**20, 16)  # K,V x 2 layers x 2 heads x 16 dims x 4 B = 512 B/token
        128
    """
    per_token = inspect_model(model).kv_bytes_per_token
    return max(0, int(budget_bytes) // (per_token * block_size))


class KVBlockPool:
    """K/V block storage of every layer plus the :class:`~infopt.kvcache.blocks.BlockAllocator` handing it out.

    Tensors are allocated on a layer's first write, with that write's dtype, device, heads and head size.
    A pool outlives the caches built on it, so prefix-cached blocks are reused across ``generate`` calls.

    Args:
        num_layers: decoder layers (one K and one V pool each).
        num_blocks: blocks per pool.
        block_size: token slots per block.
        prefix_caching: keep full blocks findable by content (see :mod:`infopt.kvcache.blocks`).
        growable: when an allocation needs more blocks than are available, grow the pool (to at least
            double) instead of raising :class:`~infopt.kvcache.blocks.OutOfBlocks`.
        scratch_blocks: block rows the tensors hold past the allocator's ``num_blocks``, which no sequence can own:
            a CUDA-graph decode step points its padding rows at the first (:attr:`scratch_block`), so their writes
            and reads touch no sequence's keys. A pool with scratch blocks cannot grow.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int = 16, *, prefix_caching: bool = True,
                 growable: bool = False, scratch_blocks: int = 0):
        if scratch_blocks and growable:
            raise ValueError("a KVBlockPool with scratch_blocks cannot be growable (growing would move them)")
        self.num_layers = num_layers
        self.block_size = block_size
        self.growable = growable
        self.scratch_blocks = scratch_blocks
        self.allocator = BlockAllocator(num_blocks, block_size, prefix_caching=prefix_caching)
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def scratch_block(self) -> int | None:
        """The id of the first scratch block (the row after the allocator's blocks), or None without any."""
        return self.num_blocks if self.scratch_blocks else None

    def allocated(self) -> bool:
        """True once every layer's K/V pools exist (the first forward through the pool allocates them)."""
        return all(k is not None for k in self.keys) and all(v is not None for v in self.values)

    def storage(self, layer_idx: int, like_k: torch.Tensor, like_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's ``(K, V)`` pools, allocated on first use shaped after ``like_*`` ``[B, H_kv, q, D]``."""
        k = self.keys[layer_idx]
        if k is None:
            with torch.inference_mode(False):  # a pool made under inference_mode could never be written outside it
                n = self.num_blocks + self.scratch_blocks
                k = torch.zeros(n, self.block_size, like_k.shape[1], like_k.shape[-1], dtype=like_k.dtype,
                                device=like_k.device)
                self.values[layer_idx] = torch.zeros(n, self.block_size, like_v.shape[1], like_v.shape[-1],
                                                     dtype=like_v.dtype, device=like_v.device)
            self.keys[layer_idx] = k
        return k, self.values[layer_idx]

    def grow(self, n: int) -> None:
        """Add ``n`` free blocks (tensors already allocated are extended, contents kept)."""
        if n <= 0:
            return
        if self.scratch_blocks:
            raise ValueError("a KVBlockPool with scratch_blocks cannot grow")
        self.allocator.add_blocks(n)
        with torch.inference_mode(False):
            for pools in (self.keys, self.values):
                for i, t in enumerate(pools):
                    if t is not None:
                        pools[i] = torch.cat([t, t.new_zeros((n, *t.shape[1:]))])

    def ensure_available(self, n: int) -> None:
        """Make sure ``n`` blocks can be allocated: grow a growable pool (to at least double), else raise.

        Raises:
            OutOfBlocks: not growable and fewer than ``n`` blocks available; nothing changed.
        """
        if not self.provide(n):
            raise OutOfBlocks(
                f"{n} KV blocks needed, {self.allocator.num_available} available of {self.num_blocks} "
                f"({self.block_size} tokens each); build the pool with more blocks or wait for sequences to finish",
                needed=n, available=self.allocator.num_available,
            )

    def provide(self, n: int) -> bool:
        """Whether ``n`` blocks can be allocated now, growing a growable pool (to at least double) if needed;
        False (nothing changed) when a fixed-size pool has fewer available."""
        short = n - self.allocator.num_available
        if short <= 0:
            return True
        if not self.growable:
            return False
        self.grow(max(short, self.num_blocks))
        return True

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V in every layer (the copy half of copy-on-write)."""
        for pools in (self.keys, self.values):
            for t in pools:
                if t is not None:
                    t[dst].copy_(t[src])

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes across all layers (K and V); 0 before the first write."""
        return sum(t[0].numel() * t.element_size() for pools in (self.keys, self.values) for t in pools
                   if t is not None)

    @property
    def bytes_allocated(self) -> int:
        return self.block_bytes * self.num_blocks
