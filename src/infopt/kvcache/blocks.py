"""Block bookkeeping for paged KV caches: a free list, reference counts, copy-on-write and a prefix cache.

The allocator knows nothing about tensors. A *block* is an integer id naming ``block_size`` token
slots of a KV pool; sequences hold lists of block ids (their block tables). A block is in exactly
one of three states:

- **free**: on the free list, holding nothing worth keeping;
- **referenced**: held by one or more sequences (``refcount >= 1``); several holders share it
  read-only, and a holder that must write into a shared block first gets a private copy
  (:meth:`BlockAllocator.copy_on_write`);
- **cached, unreferenced**: a full block registered in the prefix cache whose last holder let it
  go. It stays resident so a later sequence with the same prefix finds it, and is evicted (least
  recently released first) only when an allocation finds the free list empty.

The prefix cache maps the hash of ``(parent block hash, token ids in the block)`` to a block id, so
a hash names a whole prefix, not just one block's tokens: two prompts share a cached block only
if everything before it matches too.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

from ..core.errors import InfoptError

__all__ = ["BlockAllocator", "OutOfBlocks", "BlockStateError", "hash_block", "chain_hashes"]


class OutOfBlocks(InfoptError, RuntimeError):
    """No free block is left (and no cached block can be evicted).

    A scheduler catches it to preempt or queue a request. Attributes ``needed`` and ``available``
    give the numbers when known.
    """

    def __init__(self, message: str, *, needed: int | None = None, available: int | None = None):
        super().__init__(message)
        self.needed = needed
        self.available = available


class BlockStateError(InfoptError, RuntimeError):
    """A block was used in a state that does not allow it: freed twice, forked while free, unknown id."""


def hash_block(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Hash of one full block: 16 bytes of BLAKE2b over the parent block's hash and the block's token ids.

    Args:
        parent: the hash of the previous block of the sequence, or None for the first block.
        tokens: the token ids in this block.

    Returns:
        The 16-byte digest (collisions are negligible, unlike Python's 64-bit ``hash``).

    Example:
        >>> hash_block(None, [1, 2, 3]) == hash_block(None, [1, 2, 3]) != hash_block(None, [1, 2, 4])
        True
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(array("q", tokens).tobytes())
    return h.digest()


def chain_hashes(tokens: Sequence[int], block_size: int, *, parent: bytes | None = None) -> list[bytes]:
    """Hashes of every full block of ``tokens`` (a trailing partial block has none).

    Example:
        >>> len(chain_hashes(list(range(40)), 16))
        2
    """
    out: list[bytes] = []
    for i in range(len(tokens) // block_size):
        parent = hash_block(parent, tokens[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


class BlockAllocator:
    """Hands out KV-cache block ids, counts references, and keeps a prefix cache of full blocks.

    Args:
        num_blocks: blocks in the pool (ids ``0 .. num_blocks - 1``).
        block_size: token slots per block (only recorded here; the allocator counts blocks).
        prefix_caching: keep released full blocks findable by content hash (:meth:`insert`,
            :meth:`lookup`); when False both are no-ops.

    Raises:
        ValueError: non-positive sizes.

    Example:
        >>> a = BlockAllocator(4, 16)
        >>> b = a.allocate(); _ = a.fork(b); a.refcount(b)
        2
        >>> a.free(b); a.free(b); a.num_free
        4
        >>> a.free(b)
        Traceback (most recent call last):
        ...
        infopt.kvcache.blocks.BlockStateError: block 0 freed twice (its refcount is already 0)
    """

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True):
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks={num_blocks!r}; must be a non-negative integer")
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size={block_size!r}; must be a positive integer")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._refs: list[int] = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used = 0
        self._block_of: dict[bytes, int] = {}  # prefix hash -> block
        self._hash_of: dict[int, bytes] = {}  # block -> prefix hash (cached blocks only)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, refcount 0; least recently released first
        self.evictions = 0
        self.hits = 0
        self.lookups = 0

    # -- sizes -----------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self._refs)

    @property
    def num_free(self) -> int:
        """Blocks on the free list (not counting evictable cached blocks)."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no sequence holds: resident for prefix hits, reclaimed when the free list runs dry."""
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one sequence."""
        return self._used

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (held or not)."""
        return len(self._hash_of)

    def refcount(self, block: int) -> int:
        self._check_id(block)
        return self._refs[block]

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def add_blocks(self, n: int) -> None:
        """Grow the pool by ``n`` free blocks (ids continue after the current last one)."""
        start = len(self._refs)
        self._refs.extend([0] * n)
        self._free.extend(range(start, start + n))

    # -- allocation ------------------------------------------------------------------------
    def allocate(self) -> int:
        """A block with refcount 1: from the free list, else by evicting the least recently released cached block.

        Raises:
            OutOfBlocks: every block is held by a sequence.
        """
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
            self.evictions += 1
        else:
            raise OutOfBlocks(
                f"all {self.num_blocks} KV blocks are held by running sequences; free some (finish or preempt a "
                "sequence) or build the cache with more blocks",
                needed=1, available=0,
            )
        self._refs[block] = 1
        self._used += 1
        return block

    def try_allocate(self, n: int) -> list[int] | None:
        """``n`` blocks at once, or None (nothing taken) when fewer than ``n`` are available: a scheduler's
        question, answered without an exception.

        Example:
            >>> a = BlockAllocator(num_blocks=2, block_size=4)
            >>> a.try_allocate(3) is None, a.try_allocate(2)
            (True, [0, 1])
        """
        if n > self.num_available:
            return None
        return [self.allocate() for _ in range(n)]

    def allocate_many(self, n: int) -> list[int]:
        """``n`` blocks at once, or none: raises before taking any when fewer than ``n`` are available.

        Raises:
            OutOfBlocks: fewer than ``n`` blocks available.
        """
        blocks = self.try_allocate(n)
        if blocks is None:
            raise OutOfBlocks(
                f"{n} KV blocks needed, {self.num_available} available of {self.num_blocks}",
                needed=n, available=self.num_available,
            )
        return blocks

    def fork(self, block: int) -> int:
        """Share a held block with one more holder (refcount + 1); writes then go through :meth:`copy_on_write`.

        Raises:
            BlockStateError: the block is not held by anyone.
        """
        self._check_id(block)
        if self._refs[block] == 0:
            raise BlockStateError(f"block {block} is not held by any sequence; only held blocks can be forked")
        self._refs[block] += 1
        return block

    def free(self, block: int) -> None:
        """Drop one reference. At zero, a cached block becomes evictable, any other goes back to the free list.

        Raises:
            BlockStateError: the block's refcount is already 0 (a double free).
        """
        self._check_id(block)
        if self._refs[block] == 0:
            raise BlockStateError(f"block {block} freed twice (its refcount is already 0)")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._used -= 1
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def free_many(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            self.free(b)

    def writable(self, block: int) -> bool:
        """True when the caller is the only holder and the block is not a cached (immutable) prefix block."""
        return self.refcount(block) == 1 and block not in self._hash_of

    def copy_on_write(self, block: int, copy: Callable[[int, int], None]) -> int:
        """The block to write into instead of ``block``: ``block`` itself when :meth:`writable`, else a fresh
        block that ``copy(src, dst)`` fills with ``block``'s contents; the caller's reference moves to it.

        Raises:
            OutOfBlocks: a copy is needed and no block is available (nothing changed).
        """
        if self.writable(block):
            return block
        new = self.allocate()  # `block` is still held here, so this cannot evict it
        copy(block, new)
        self.free(block)
        return new

    # -- prefix cache ----------------------------------------------------------------------
    def lookup(self, h: bytes) -> int | None:
        """The cached block whose prefix hash is ``h``, with one more reference for the caller, or None.

        An evictable block found here is held again, so it cannot be evicted while in use.
        """
        self.lookups += 1
        block = self._block_of.get(h) if self.prefix_caching else None
        if block is None:
            return None
        self.hits += 1
        if self._refs[block] == 0:
            del self._evictable[block]
            self._used += 1
        self._refs[block] += 1
        return block

    def contains(self, h: bytes) -> bool:
        """True when a block with prefix hash ``h`` is cached (no reference taken)."""
        return self.prefix_caching and h in self._block_of

    def insert(self, h: bytes, block: int) -> int:
        """Register the full, held ``block`` as the cached block for prefix hash ``h``.

        Returns:
            The block the caller now holds: ``block`` itself, or the block already cached under
            ``h`` (same tokens, same prefix, so same K/V); the caller's reference then moves there
            and ``block`` is freed, so duplicates do not pile up.

        Raises:
            BlockStateError: ``block`` is not held.
        """
        self._check_id(block)
        if self._refs[block] == 0:
            raise BlockStateError(f"block {block} is not held; only a held, filled block can enter the prefix cache")
        if not self.prefix_caching:
            return block
        existing = self._block_of.get(h)
        if existing is None:
            if block in self._hash_of:  # already cached under another hash: keep its first identity
                return block
            self._block_of[h] = block
            self._hash_of[block] = h
            return block
        if existing == block:
            return block
        self.lookup(h)
        self.lookups -= 1  # bookkeeping move, not a prefix lookup
        self.hits -= 1
        self.free(block)
        return existing

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: evictable blocks go back to the free list; held blocks stay held."""
        for block in self._evictable:
            self._free.append(block)
        self._evictable.clear()
        self._block_of.clear()
        self._hash_of.clear()

    # -- checks ----------------------------------------------------------------------------
    def _check_id(self, block: int) -> None:
        if not isinstance(block, int) or not 0 <= block < len(self._refs):
            raise BlockStateError(f"block id {block!r} is not in this pool (0..{len(self._refs) - 1})")

    def check_invariants(self) -> None:
        """Raise :class:`BlockStateError` if the bookkeeping is inconsistent (used by tests and debugging).

        Every block is exactly one of free, held (refcount > 0) or cached-unreferenced; the free list
        has no duplicates; the two prefix maps mirror each other.
        """
        free = set(self._free)
        if len(free) != len(self._free):
            raise BlockStateError("the free list holds a block twice")
        held = {b for b, r in enumerate(self._refs) if r > 0}
        if any(r < 0 for r in self._refs):
            raise BlockStateError("a refcount is negative")
        evictable = set(self._evictable)
        if free & held or free & evictable or held & evictable:
            raise BlockStateError("a block is in two states at once")
        if len(free) + len(held) + len(evictable) != self.num_blocks:
            raise BlockStateError(
                f"blocks leaked: {len(free)} free + {len(held)} held + {len(evictable)} evictable != {self.num_blocks}"
            )
        if self._used != len(held):
            raise BlockStateError(f"used counter {self._used} != {len(held)} held blocks")
        if {self._block_of[h] for h in self._block_of} != set(self._hash_of) or any(
            self._block_of[h] != b for b, h in self._hash_of.items()
        ):
            raise BlockStateError("the prefix-cache maps disagree")
        if not evictable <= set(self._hash_of) or free & set(self._hash_of):
            raise BlockStateError("an evictable block is not cached, or a free block is")

    def stats(self) -> dict[str, int]:
        """Counts for reports: blocks, free, used, cached, evictable, evictions, prefix lookups and hits."""
        return {
            "num_blocks": self.num_blocks, "block_size": self.block_size, "free": self.num_free,
            "used": self.num_used, "cached": self.num_cached, "evictable": self.num_evictable,
            "evictions": self.evictions, "prefix_lookups": self.lookups, "prefix_hits": self.hits,
        }
