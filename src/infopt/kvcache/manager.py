"""Which KV blocks each sequence holds: the bookkeeping of a paged cache, in pure Python (no tensors, no torch).

A :class:`KVBlockManager` keeps, per sequence, its block table, how many token slots it has written, which of them
belong to completed forwards, its known token ids and the prefix hashes of its full blocks. It asks a
:class:`~infopt.kvcache.blocks.BlockAllocator` for blocks and never raises for a full pool: :meth:`allocate`
answers None and changes nothing, so a scheduler decides what to preempt. Two callbacks connect it to the K/V
storage without touching tensors itself: ``provide(n)`` (make ``n`` blocks available, growing a growable pool;
False when it cannot) and ``copy_block(src, dst)`` (the data half of copy-on-write).

:class:`~infopt.kvcache.PagedCache` lays its steps out over one of these (``cache.blocks``); the engine's
:class:`~infopt.batching.scheduler.Scheduler` admits, allocates and preempts through it, so scheduling runs and is
tested with no model.

Example:
    >>> from infopt.kvcache.blocks import BlockAllocator
    >>> kv = KVBlockManager(BlockAllocator(4, 4), 4)
    >>> kv.add_sequence("a", [1, 2, 3, 4, 5])  # nothing cached yet
    0
    >>> kv.allocate([("a", [1, 2, 3, 4, 5])]), kv.block_table("a")  # the step's start positions, then its blocks
    ([0], [0, 1])
    >>> kv.complete(["a"]); kv.allocate([("a", list(range(20)))]) is None  # 25 tokens need 7 blocks: None
    True
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from .blocks import BlockAllocator, hash_block

__all__ = ["KVBlockManager", "SeqBlocks"]


@dataclass
class SeqBlocks:
    """One sequence's blocks and tokens."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0  # slots written, the in-flight step included
    done: int = 0  # slots written by completed forwards (safe to share)
    tokens: list[int] = field(default_factory=list)  # known token ids by position
    hashes: list[bytes] = field(default_factory=list)  # prefix hashes of blocks[:len(hashes)], all in the prefix cache


class KVBlockManager:
    """Sequences' block tables over a :class:`~infopt.kvcache.blocks.BlockAllocator` (module docstring).

    Args:
        allocator: where blocks come from (its prefix cache serves :meth:`add_sequence`).
        block_size: token slots per block.
        provide: ``provide(n) -> bool``: make ``n`` blocks available (default: whether the allocator has them).
        copy_block: ``copy_block(src, dst)``: copy one block's data for copy-on-write (default: nothing to copy).
    """

    def __init__(self, allocator: BlockAllocator, block_size: int, *, provide: Callable[[int], bool] | None = None,
                 copy_block: Callable[[int, int], None] | None = None):
        self.allocator = allocator
        self.block_size = block_size
        self._provide = provide or (lambda n: allocator.num_available >= n)
        self._copy_block = copy_block or (lambda src, dst: None)
        self.seqs: dict[Hashable, SeqBlocks] = {}

    # -- sequences --------------------------------------------------------------------------------
    def seq(self, seq_id: Hashable) -> SeqBlocks:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise KeyError(f"no sequence {seq_id!r} in this KV cache (add it with add_sequence)") from None

    def seq_len(self, seq_id: Hashable) -> int:
        """Tokens stored for ``seq_id``."""
        return self.seq(seq_id).length

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self.seq(seq_id).blocks)

    def add_sequence(self, seq_id: Hashable, tokens: Sequence[int] | None = None) -> int:
        """Start a sequence; with its prompt ``tokens`` known, reuse the longest cached prefix of full blocks.

        At least one prompt token is always left uncached, so the caller has a token to compute logits from.

        Returns:
            How many leading tokens are already in the cache: feed ``tokens[returned:]`` next.

        Raises:
            ValueError: ``seq_id`` already exists.
        """
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already exists in this KV cache")
        seq = SeqBlocks(tokens=[int(t) for t in tokens] if tokens is not None else [])
        alloc, bs = self.allocator, self.block_size
        parent = None
        for i in range(max(0, len(seq.tokens) - 1) // bs if alloc.prefix_caching else 0):
            h = hash_block(parent, seq.tokens[i * bs:(i + 1) * bs])
            block = alloc.lookup(h)
            if block is None:
                break
            seq.blocks.append(block)
            seq.hashes.append(h)
            parent = h
        seq.length = seq.done = len(seq.blocks) * bs
        self.seqs[seq_id] = seq
        return seq.length

    def fork_sequence(self, src: Hashable, dst: Hashable) -> None:
        """Start ``dst`` as a copy of ``src`` sharing all its blocks (copy-on-write on the first write into a shared
        block)."""
        if dst in self.seqs:
            raise ValueError(f"sequence {dst!r} already exists in this KV cache")
        s = self.seq(src)
        self.seqs[dst] = SeqBlocks([self.allocator.fork(b) for b in s.blocks], s.length, s.done, list(s.tokens),
                                   list(s.hashes))

    def truncate(self, seq: SeqBlocks, length: int, *, keep_tokens: bool) -> None:
        """Keep the first ``length`` slots of ``seq``, freeing the blocks past them (and its token ids past them
        unless ``keep_tokens``)."""
        length = max(0, min(length, seq.length))
        keep = -(-length // self.block_size)
        self.allocator.free_many(seq.blocks[keep:])
        del seq.blocks[keep:]
        del seq.hashes[length // self.block_size:]
        seq.length = length
        seq.done = min(seq.done, length)
        if not keep_tokens:
            del seq.tokens[length:]

    def release(self, seq_id: Hashable) -> None:
        """End a sequence: its full blocks are already in the prefix cache; every block loses this reference."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"no sequence {seq_id!r} in this KV cache")
        self.allocator.free_many(seq.blocks)
        seq.blocks.clear()

    def release_all(self) -> None:
        for seq_id in list(self.seqs):
            self.release(seq_id)

    # -- blocks for steps -------------------------------------------------------------------------
    def needed(self, seq: SeqBlocks, start: int, n: int) -> int:
        """Blocks writing ``n`` slots from ``start`` allocates (a copy-on-write copy included)."""
        bs = self.block_size
        cow = 1 if start % bs and start // bs < len(seq.blocks) and not self.allocator.writable(
            seq.blocks[start // bs]) else 0
        return cow + max(0, -(-(start + n) // bs) - len(seq.blocks))

    def blocks_needed(self, seq_id: Hashable, n: int) -> int:
        """Blocks a step adding ``n`` tokens to ``seq_id`` would allocate; a scheduler's admission check."""
        seq = self.seq(seq_id)
        return self.needed(seq, seq.length, n)

    def blocks_needed_for(self, entries: Iterable[tuple[Hashable, Sequence[int]]]) -> int:
        """Blocks a step of these ``(seq_id, new_tokens)`` entries would allocate."""
        return sum(self.blocks_needed(sid, len(toks)) for sid, toks in entries)

    def provide(self, n: int) -> bool:
        """Whether ``n`` blocks can be allocated now (growing a growable pool through the callback)."""
        return self._provide(n)

    def reserve(self, seq: SeqBlocks, start: int, n: int) -> None:
        """Give ``seq`` the blocks for ``n`` slots from ``start`` (the caller made sure they are available)."""
        bs = self.block_size
        if start % bs and start // bs < len(seq.blocks):
            i = start // bs
            seq.blocks[i] = self.allocator.copy_on_write(seq.blocks[i], self._copy_block)
        more = -(-(start + n) // bs) - len(seq.blocks)
        if more > 0:
            seq.blocks.extend(self.allocator.allocate_many(more))
        seq.length = start + n

    def allocate(self, entries: Sequence[tuple[Hashable, Sequence[int]]]) -> list[int] | None:
        """Reserve one step's blocks: each ``(seq_id, new_token_ids)`` continues its sequence.

        Returns:
            Each sequence's start position (its length before the step), or None when the pool cannot provide
            the step's blocks (nothing changed: drop or preempt a sequence and try again).

        Raises:
            KeyError: an unknown ``seq_id``. ValueError: no entries, a sequence twice, or one with no tokens.
        """
        if not entries:
            raise ValueError("a step needs at least one (seq_id, tokens) entry")
        ids = [sid for sid, _ in entries]
        if len(set(ids)) != len(ids):
            raise ValueError(f"a sequence appears twice in one step: {ids}")
        seqs = [self.seq(sid) for sid in ids]
        if any(not toks for _, toks in entries):
            raise ValueError("every sequence in a step needs at least one new token")
        starts = [s.length for s in seqs]
        if not self.provide(sum(self.needed(s, st, len(toks)) for s, st, (_, toks) in zip(seqs, starts, entries,
                                                                                          strict=True))):
            return None
        for seq, st, (_, toks) in zip(seqs, starts, entries, strict=True):
            self.reserve(seq, st, len(toks))
            seq.tokens[st:st + len(toks)] = [int(t) for t in toks]
        return starts

    def complete(self, seq_ids: Iterable[Hashable]) -> None:
        """A step's forward finished: its slots become shareable and full blocks enter the prefix cache."""
        for sid in seq_ids:
            seq = self.seqs.get(sid)
            if seq is not None:
                seq.done = seq.length
                self._commit(seq)

    def abort(self, seq_ids: Iterable[Hashable]) -> None:
        """A step's forward failed: its sequences go back to their length before it (their tokens stay known)."""
        for sid in seq_ids:
            seq = self.seqs.get(sid)
            if seq is not None:
                self.truncate(seq, seq.done, keep_tokens=True)

    def _commit(self, seq: SeqBlocks) -> None:
        """Enter the sequence's newly completed full blocks whose tokens are known into the prefix cache."""
        alloc, bs = self.allocator, self.block_size
        if not alloc.prefix_caching:
            return
        parent = seq.hashes[-1] if seq.hashes else None
        for i in range(len(seq.hashes), min(seq.done, len(seq.tokens)) // bs):
            parent = hash_block(parent, seq.tokens[i * bs:(i + 1) * bs])
            seq.blocks[i] = alloc.insert(parent, seq.blocks[i])
            seq.hashes.append(parent)
