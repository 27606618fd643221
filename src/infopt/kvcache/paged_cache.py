"""A transformers ``Cache`` over a paged KV pool: per-sequence block tables, step layouts, prefix reuse.

The K/V tensors live in a :class:`~infopt.kvcache.pool.KVBlockPool`; this module keeps the sequences.

Two ways to drive a :class:`PagedCache`:

- **packed steps** (for a batching engine): :meth:`PagedCache.add_sequence`, then per forward
  :meth:`PagedCache.begin_step` with each sequence's new tokens (a prefill chunk or one decode
  token). The returned :class:`PagedBatch` holds ``input_ids``/``position_ids`` of shape ``[1, N]``
  (all sequences flattened into one row) for one ``model(...)`` call; :meth:`PagedCache.end_step`
  after it. :meth:`PagedCache.step` does all three.
- **padded generate**: :func:`infopt.kvcache.use_` with :class:`~infopt.kvcache.Paged` hands a
  :class:`PaddedPagedCache` to ``model.generate``; each row of the left-padded batch is one sequence, padding is
  never stored, and the step layout is derived from the columns each forward receives.

Both keep their sequences' blocks in a pure-Python :class:`~infopt.kvcache.manager.KVBlockManager`
(``cache.blocks``) and lay steps out in tensors over it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from ..attention.paged import PAGED_IMPL, PagedAttentionMetadata, PagedStep, bind
from ..core.compat import CACHE_KWARG
from ..core.errors import IncompatibleModelError
from ..core.introspect import inspect_model
from .blocks import BlockAllocator, BlockStateError, OutOfBlocks
from .decode_buffers import DecodeBuffers
from .manager import KVBlockManager, SeqBlocks
from .pool import KVBlockPool

__all__ = ["PagedCache", "PaddedPagedCache", "PagedBatch"]


@dataclass
class PagedBatch:
    """The inputs of one packed forward, returned by :meth:`PagedCache.begin_step`.

    Attributes:
        seq_ids: the sequences in the step, in order.
        input_ids: ``[1, N]`` every sequence's new tokens, concatenated in ``seq_ids`` order.
        position_ids: ``[1, N]`` each token's position in its own sequence.
        logits_indices: ``[S]`` index in ``N`` of each sequence's last new token; pass it as
            ``logits_to_keep`` so the model computes only the logits the sampler needs.
        new_tokens: ``[S]`` tokens each sequence contributes.
    """

    seq_ids: tuple[Hashable, ...]
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    logits_indices: torch.Tensor
    new_tokens: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


class _PagedLayer(CacheLayerMixin):
    """Placeholder layer so transformers' ``Cache`` bookkeeping (``len``, ``is_sliding``) works; storage is the pool."""

    is_compileable = False
    is_sliding = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, owner: PagedCache):
        super().__init__()
        self._owner = owner
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise BlockStateError("PagedCache layers are updated through PagedCache.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return self._owner.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        pass


class PagedCache(Cache):
    """A transformers ``Cache`` storing K/V in the blocks of a :class:`KVBlockPool`, one block table per sequence.

    Its ``update`` writes new K/V into the blocks and hands the layer's pools to the ``paged``
    attention backend (:mod:`infopt.attention.paged`), which the model must use.

    Args:
        pool: the block pool (shared with other caches, and across calls, for prefix reuse).
        config: the model's config; checked to use the paged attention backend before each step.
        device: where packed-step inputs and metadata go (the model's device; default CPU).

    Example (packed steps, as a batching engine drives it):
        >>> import torch, infopt
        >>> from infopt.models import tiny_model
        >>> model = infopt.attention.set_backend_(tiny_model(), "paged")
        >>> cache = PagedCache.for_model(model, num_blocks=32)
        >>> cache.add_sequence("a", [1, 2, 3, 4, 5]), cache.add_sequence("b", [7, 8])
        (0, 0)
        >>> with torch.no_grad():
        ...     logits = cache.step(model, [("a", [1, 2, 3, 4, 5]), ("b", [7, 8])])  # both prefills, one forward
        ...     logits = cache.step(model, [("a", [9]), ("b", [9])])  # one decode token each
        >>> logits.shape[0], cache.seq_len("a"), cache.seq_len("b")
        (2, 6, 3)
    """

    _packed = True  # serves packed steps (a PaddedPagedCache serves one padded generate call instead)

    def __init__(self, pool: KVBlockPool, *, config: Any = None, device: torch.device | str | None = None):
        super().__init__(layers=[_PagedLayer(self) for _ in range(pool.num_layers)])
        self.pool = pool
        self.block_size = pool.block_size
        self._config = config
        # the sequences' blocks (pure-Python bookkeeping); this class lays steps out over them
        self.blocks = KVBlockManager(pool.allocator, pool.block_size, provide=pool.provide, copy_block=pool.copy_block)
        self._meta: PagedAttentionMetadata | None = None
        self._slots: torch.Tensor | None = None
        self._step_ids: tuple[Hashable, ...] = ()
        self._layers_done: set[int] = set()
        self._n_tokens = 0
        self.device = torch.device(device) if device is not None else None
        self.tokens_computed = 0  # tokens run through the model (prefix hits excluded)

    @classmethod
    def for_model(cls, model: nn.Module, num_blocks: int, block_size: int = 16, *,
                  prefix_caching: bool = True, scratch_blocks: int = 0) -> PagedCache:
        """A cache with its own pool of ``num_blocks`` blocks sized for ``model`` (see :func:`num_blocks_for_budget`);
        ``scratch_blocks``: see :class:`~infopt.kvcache.pool.KVBlockPool`."""
        info = inspect_model(model)
        pool = KVBlockPool(info.num_layers, num_blocks, block_size, prefix_caching=prefix_caching,
                           scratch_blocks=scratch_blocks)
        return cls(pool, config=model.config, device=info.device)

    # -- sequences (kept by self.blocks) --------------------------------------------------------
    @property
    def allocator(self) -> BlockAllocator:
        return self.pool.allocator

    @property
    def _seqs(self) -> dict[Hashable, SeqBlocks]:
        return self.blocks.seqs

    def seq_len(self, seq_id: Hashable) -> int:
        """Tokens stored for ``seq_id``."""
        return self.blocks.seq_len(seq_id)

    def block_table(self, seq_id: Hashable) -> list[int]:
        return self.blocks.block_table(seq_id)

    @property
    def seq_ids(self) -> list[Hashable]:
        return list(self._seqs)

    def add_sequence(self, seq_id: Hashable, tokens: Sequence[int] | None = None) -> int:
        """Start a sequence; with its prompt ``tokens`` known, reuse the longest cached prefix of full blocks
        (:meth:`KVBlockManager.add_sequence <infopt.kvcache.manager.KVBlockManager.add_sequence>`).

        Returns:
            How many leading tokens are already in the cache: feed ``tokens[returned:]`` next.

        Raises:
            ValueError: ``seq_id`` already exists.
        """
        return self.blocks.add_sequence(seq_id, tokens)

    def fork_sequence(self, src: Hashable, dst: Hashable) -> None:
        """Start ``dst`` as a copy of ``src`` sharing all its blocks (copy-on-write: the first write into the shared
        last block gives the writer its own copy). For parallel sampling or beam-style branching."""
        self.blocks.fork_sequence(src, dst)

    def truncate(self, seq_id: Hashable, length: int) -> None:
        """Keep the first ``length`` tokens of a sequence, freeing the blocks past them (speculative rollback)."""
        self.blocks.truncate(self.blocks.seq(seq_id), length, keep_tokens=False)

    def blocks_needed(self, seq_id: Hashable, n: int) -> int:
        """Blocks a step adding ``n`` tokens to ``seq_id`` would allocate (a copy-on-write copy included);
        a scheduler's admission check."""
        return self.blocks.blocks_needed(seq_id, n)

    def release(self, seq_id: Hashable) -> None:
        """End a sequence: its full blocks are already in the prefix cache; every block loses this reference."""
        self.blocks.release(seq_id)

    def release_all(self) -> None:
        self.blocks.release_all()
        self._meta = None

    # -- steps ----------------------------------------------------------------------------------
    def _check_packed_step(self) -> None:
        if not self._packed:
            raise BlockStateError("this PagedCache serves a padded generate call; packed steps need their own cache")
        self._check_backend()

    def _check_backend(self) -> None:
        impl = getattr(self._config, "_attn_implementation", PAGED_IMPL)
        if impl != PAGED_IMPL:
            raise IncompatibleModelError(
                f"the model's attention backend is {impl!r}; a PagedCache is read by the paged backend only. "
                "Fix: infopt.attention.set_backend_(model, 'paged')"
            )

    def begin_step(self, entries: Iterable[tuple[Hashable, Sequence[int] | torch.Tensor]]) -> PagedBatch:
        """Lay out one packed forward: each ``(seq_id, new_token_ids)`` continues its sequence.

        Allocates the blocks the step needs (copy-on-write where a sequence writes into a shared
        block) and records the metadata the attention backend reads. Call ``model(input_ids=...,
        position_ids=..., past_key_values=cache)`` with the returned batch next, then :meth:`end_step`.

        Returns:
            :class:`PagedBatch`.

        Raises:
            OutOfBlocks: the step needs more blocks than are available; nothing was changed, so the caller
                can drop or preempt a sequence and try again (:meth:`try_begin_step` answers None instead).
            KeyError: unknown ``seq_id``; ValueError: a sequence twice or with no tokens.
            BlockStateError: the previous step's forward did not finish (call :meth:`abort_step`).
        """
        entries = list(entries)
        batch = self.try_begin_step(entries)
        if batch is None:
            need = self.blocks_needed_for(entries)
            raise OutOfBlocks(f"the step needs {need} KV blocks, {self.allocator.num_available} available of "
                              f"{self.allocator.num_blocks}; drop or preempt a sequence and try again",
                              needed=need, available=self.allocator.num_available)
        return batch

    def blocks_needed_for(self, entries: Iterable[tuple[Hashable, Sequence[int] | torch.Tensor]]) -> int:
        """Blocks a step of these ``(seq_id, new_tokens)`` entries would allocate."""
        return self.blocks.blocks_needed_for(entries)

    def try_begin_step(self, entries: Iterable[tuple[Hashable, Sequence[int] | torch.Tensor]]) -> PagedBatch | None:
        """:meth:`begin_step`, answering None (nothing changed) when the pool cannot provide the step's blocks,
        so a scheduler decides what to preempt without an exception.

        Raises:
            KeyError, ValueError, BlockStateError: as :meth:`begin_step` (misuse, not a full pool).
        """
        self._check_packed_step()
        self._finish_pending()
        entries = [(sid, [int(t) for t in (toks.tolist() if torch.is_tensor(toks) else toks)]) for sid, toks in entries]
        starts = self.blocks.allocate(entries)
        if starts is None:
            return None
        batch = self.layout_step(entries, starts)
        self._step_ids = batch.seq_ids  # this cache allocated: end_step / abort_step record the step's blocks
        return batch

    def layout_step(self, entries: Sequence[tuple[Hashable, Sequence[int]]], starts: Sequence[int]) -> PagedBatch:
        """The layout half of :meth:`try_begin_step`, for entries whose blocks ``self.blocks.allocate(entries)``
        already reserved (it returned ``starts``): the packed inputs and the attention metadata of the step.

        Whoever allocated also records the outcome on ``self.blocks`` (``complete(ids)`` after the forward,
        ``abort(ids)`` if it failed, as the engine's scheduler does); :meth:`end_step` / :meth:`abort_step` then
        only close the layout.

        Raises:
            BlockStateError: this cache serves a padded generate call, or the previous step was not ended
                (:meth:`end_step` or :meth:`abort_step` first: ending it now would count this step's slots as done).
        """
        self._check_packed_step()
        if self._meta is not None:
            raise BlockStateError("the previous step was not ended: call end_step() or abort_step() before laying out "
                                  "the next one")
        ids = [sid for sid, _ in entries]
        seqs = [self.blocks.seq(sid) for sid in ids]
        starts = list(starts)
        news = [len(toks) for _, toks in entries]
        device = self.device or torch.device("cpu")
        # flattened tokens: sequence s owns N-range [off_s, off_s + n_s), positions start_s + i
        n = torch.tensor(news, dtype=torch.long)
        start = torch.tensor(starts, dtype=torch.long)
        total, s_count, q = int(n.sum()), len(seqs), int(n.max())
        seq_of = torch.repeat_interleave(torch.arange(s_count), n)  # [N]
        off = n.cumsum(0) - n
        idx = torch.arange(total) - off[seq_of]  # [N] index inside its sequence's new tokens
        pos = start[seq_of] + idx  # [N]
        grid_i = torch.arange(q)[None, :]  # [1, Q]
        inside = grid_i < n[:, None]  # [S, Q]
        gather = off[:, None] + torch.minimum(grid_i, n[:, None] - 1)  # [S, Q]
        query_pos = torch.where(inside, start[:, None] + grid_i, 0)
        table = self._table(seqs)
        slots = table[seq_of, pos // self.block_size] * self.block_size + pos % self.block_size
        self._set_meta(table, start + n, query_pos, n, gather=gather, scatter=seq_of * q + idx, token_index=None,
                       slots=slots, device=device)
        self._step_ids = ()  # the allocator's to complete (try_begin_step sets its own)
        self._n_tokens = total
        tokens = torch.tensor([t for _, toks in entries for t in toks], dtype=torch.long, device=device)
        return PagedBatch(tuple(ids), tokens[None], pos[None].to(device), (off + n - 1).to(device), news)

    def layout_decode(self, entries: Sequence[tuple[Hashable, Sequence[int]]], starts: Sequence[int],
                      buffers: DecodeBuffers, b: int, w: int) -> PagedBatch:
        """:meth:`layout_step` for a step in which every sequence decodes one token, written into the fixed
        ``buffers`` of a ``(b, w)`` bucket (rows past the step's are padding) rather than into new tensors: what a
        CUDA graph captured over those buffers replays. The batch's tensors are views of the buffers, ``b`` rows
        long; its ``logits_indices`` are rows ``0..b-1``.

        Raises:
            BlockStateError: as :meth:`layout_step`; ValueError: a sequence with more than one new token, or a step
                that does not fit the bucket.
        """
        self._check_packed_step()
        if self._meta is not None:
            raise BlockStateError("the previous step was not ended: call end_step() or abort_step() before laying out "
                                  "the next one")
        if any(len(toks) != 1 for _, toks in entries):
            raise ValueError("layout_decode lays out steps of one new token per sequence; use layout_step")
        ids = [sid for sid, _ in entries]
        buffers.stage([toks[0] for _, toks in entries], list(starts), [self.blocks.seq(sid).blocks for sid in ids],
                      b=b, w=w)
        self._meta = buffers.meta(b, w)
        self._slots = buffers.slots[:b]
        self._layers_done = set()
        self.tokens_computed += len(ids)
        self._step_ids = ()
        self._n_tokens = b
        return PagedBatch(tuple(ids), buffers.input_ids[None, :b], buffers.positions[None, :b], buffers.rows[:b],
                          [1] * len(ids))

    def step_inputs(self) -> PagedStep:
        """The laid-out step as the model's ``paged_step`` keyword, for a forward without a cache object:
        ``model(input_ids=..., position_ids=..., use_cache=False, paged_step=cache.step_inputs())``, then
        :meth:`end_step`. Each attention layer writes its new K/V and attends (the ``paged`` backend)."""
        if self._meta is None or not self._packed:
            raise BlockStateError("step_inputs() follows begin_step(...) of a packed step")
        self._layers_done = set(range(len(self.layers)))  # the forward writes every layer itself
        return PagedStep(self.pool, self._meta, self._slots)

    def end_step(self) -> None:
        """Mark the last forward finished: its tokens become shareable and full blocks enter the prefix cache."""
        self._complete_step()

    def abort_step(self) -> None:
        """Undo the bookkeeping of a forward that failed: sequences go back to their length before it."""
        if self._step_ids:
            self.blocks.abort(self._step_ids)
        self._meta = None
        self._step_ids = ()

    def step(self, model: nn.Module, entries: Iterable[tuple[Hashable, Sequence[int] | torch.Tensor]],
             **forward_kwargs) -> torch.Tensor:
        """:meth:`begin_step`, one forward of ``model``, :meth:`end_step`; returns each sequence's next-token
        logits ``[S, vocab]`` (from its last new token). A failed forward is rolled back with :meth:`abort_step`."""
        batch = self.begin_step(entries)
        try:
            out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, **{CACHE_KWARG: self},
                        use_cache=True, logits_to_keep=batch.logits_indices, **forward_kwargs)
        except BaseException:
            self.abort_step()
            raise
        self.end_step()
        return out.logits[0]

    def _table(self, seqs: list[SeqBlocks]) -> torch.Tensor:
        nb = max(1, max(len(s.blocks) for s in seqs))
        return torch.tensor([s.blocks + [0] * (nb - len(s.blocks)) for s in seqs], dtype=torch.long)

    def _set_meta(self, table, kv_lens, query_pos, new_lens, *, gather, scatter, token_index, slots, device):
        length = table.shape[1] * self.block_size
        mask = None
        if gather is None or len(new_lens) == 1:  # packed steps of several sequences attend without a grid mask
            mask = (torch.arange(length)[None, None, :] <= query_pos[:, :, None])[:, None]  # [S, 1, Q, L]

        def to(t):
            return None if t is None else t.to(device)

        self._meta = PagedAttentionMetadata(
            block_size=self.block_size, block_table=to(table), kv_lens=to(kv_lens), query_pos=to(query_pos),
            mask=to(mask), gather=to(gather), scatter=to(scatter), token_index=to(token_index),
            new_lens=to(new_lens),
            single=(int(new_lens[0]), int(kv_lens[0])) if len(new_lens) == 1 and token_index is None else None,
            decode=gather is not None and token_index is None and bool((new_lens == 1).all()),
            max_new=int(new_lens.max()), max_kv=int(kv_lens.max()),
            host_lens=None if gather is None else (new_lens.tolist(), kv_lens.tolist(), gather[:, 0].tolist()),
        )
        self._slots = to(slots)
        self._layers_done = set()
        self.tokens_computed += int(new_lens.sum())

    def _finish_pending(self) -> None:
        if self._meta is None:
            return
        if len(self._layers_done) < len(self.layers):
            raise BlockStateError(
                "the previous step's forward did not run through every layer; call abort_step() before the next step"
            )
        self._complete_step()

    def _complete_step(self) -> None:
        if self._meta is None:
            return
        if self._step_ids:  # a step this cache allocated (layout_step's belong to their allocator)
            self.blocks.complete(self._step_ids)
        self._meta = None
        self._step_ids = ()

    # -- transformers Cache API -----------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new K/V ``[B, H_kv, q, D]`` into the blocks; return the layer's pools for the paged backend."""
        if self._meta is None or layer_idx in self._layers_done:
            self._layout_for_forward(key_states.shape[2], key_states.device)
        b, _, q, _ = key_states.shape
        if b * q != self._n_tokens:
            raise BlockStateError(f"the forward has {b * q} tokens but the step was laid out for {self._n_tokens}")
        self._layers_done.add(layer_idx)
        k_pool, v_pool = PagedStep(self.pool, self._meta, self._slots).write(layer_idx, key_states, value_states)
        bind(k_pool, v_pool, self._meta)
        return k_pool, v_pool

    def _layout_for_forward(self, q: int, device: torch.device) -> None:
        raise BlockStateError("call PagedCache.begin_step(...) before each forward (or use PagedCache.step)")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """0: packed steps hand each forward its positions (a :class:`PaddedPagedCache` counts columns)."""
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        # the paged backend ignores the mask transformers builds; keep it [.., q, q] small
        return query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("in packed mode, roll a sequence back with PagedCache.truncate(seq_id, length)")

    def reset(self) -> None:
        """Release every sequence (the pool and its prefix cache stay)."""
        self.release_all()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("PagedCache does not serve beam search; infopt routes it to the original generate")

    # -- memory ---------------------------------------------------------------------------------
    def memory_stats(self) -> dict[str, float]:
        """Bytes allocated (the whole pool) and used (blocks held x bytes per block), cached prefix blocks,
        and block utilization: the fraction of slots in the held blocks that hold a token.

        Example:
            >>> from infopt.models import tiny_model
            >>> PagedCache.for_model(tiny_model(), num_blocks=8).memory_stats()["blocks_free"]
            8
        """
        alloc, bs, bb = self.allocator, self.block_size, self.pool.block_bytes
        fill: dict[int, int] = {}
        for seq in self._seqs.values():
            for i, blk in enumerate(seq.blocks):
                fill[blk] = max(fill.get(blk, 0), min(bs, seq.length - i * bs))
        return {
            "num_blocks": alloc.num_blocks, "block_size": bs, "block_bytes": bb,
            "blocks_used": alloc.num_used, "blocks_cached": alloc.num_evictable, "blocks_free": alloc.num_free,
            "bytes_allocated": self.pool.bytes_allocated, "bytes_used": alloc.num_used * bb,
            "bytes_cached": alloc.num_evictable * bb,
            "utilization": sum(fill.values()) / (len(fill) * bs) if fill else 0.0,
            "sequences": len(self._seqs), "tokens": sum(s.length for s in self._seqs.values()),
        }


class PaddedPagedCache(PagedCache):
    """The padded-``generate`` adapter over the same pool and block manager as :class:`PagedCache`: each row of a
    left-padded batch is one sequence, padding is never stored, and each forward's layout is derived from the
    columns it receives (:func:`infopt.kvcache.use_` with :class:`~infopt.kvcache.Paged` makes one per call).
    The packed-step API is refused."""

    _packed = False

    def __init__(self, pool: KVBlockPool, *, config: Any = None, device: torch.device | str | None = None):
        super().__init__(pool, config=config, device=device)
        self._pads: list[int] = []  # left padding per row
        self._columns = 0

    def start_padded(self, rows: Sequence[Sequence[int]], pads: Sequence[int], max_new_tokens: int) -> int:
        """Serve one left-padded ``generate`` batch: row ``b`` holds ``pads[b]`` padding columns then ``rows[b]``.

        Looks each row's prompt up in the prefix cache and makes sure the pool can hold the whole call.

        Returns:
            The number of leading columns already cached for every row (``generate`` then runs the model on
            the remaining columns only).

        Raises:
            OutOfBlocks: the call does not fit a fixed-size pool (the cache is left empty).
        """
        self._check_backend()
        self._pads = [int(p) for p in pads]
        hits = [self.add_sequence(b, row) for b, row in enumerate(rows)]
        columns = min(p + h for p, h in zip(self._pads, hits, strict=True))
        need = 0
        for b, p in enumerate(self._pads):
            seq = self._seqs[b]
            self.blocks.truncate(seq, max(0, columns - p), keep_tokens=True)
            need += self.blocks.needed(seq, seq.length, len(rows[b]) - seq.length + max_new_tokens)
        try:
            self.pool.ensure_available(need)
        except OutOfBlocks:
            self.release_all()
            raise
        self._columns = columns
        return columns

    def _layout_for_forward(self, q: int, device: torch.device) -> None:
        self._complete_step()
        c0, bs = self._columns, self.block_size
        pads = torch.tensor(self._pads, dtype=torch.long)
        pos = torch.arange(c0, c0 + q)[None, :] - pads[:, None]  # [B, q] position in the row's sequence
        valid = pos >= 0
        seqs = [self._seqs[b] for b in range(len(self._pads))]
        starts = [max(0, c0 - p) for p in self._pads]
        news = [c0 + q - max(c0, p) for p in self._pads]
        for seq, st in zip(seqs, starts, strict=True):
            if seq.length != st:
                raise BlockStateError(f"padded step out of sync: a row holds {seq.length} tokens, expected {st}")
        self.pool.ensure_available(sum(self.blocks.needed(s, st, n) for s, st, n in zip(seqs, starts, news, strict=True)))
        for seq, st, n in zip(seqs, starts, news, strict=True):
            self.blocks.reserve(seq, st, n)
        self._columns = c0 + q
        table = self._table(seqs)
        query_pos = pos.clamp(min=0)
        slots = torch.gather(table, 1, query_pos // bs) * bs + query_pos % bs  # [B, q]
        token_index = None if bool(valid.all()) else valid.flatten().nonzero().squeeze(1)
        slots = slots.flatten() if token_index is None else slots.flatten()[token_index]
        self._set_meta(table, torch.tensor([s.length for s in seqs]), query_pos, torch.tensor(news), gather=None,
                       scatter=None, token_index=token_index, slots=slots, device=device)
        self._step_ids = tuple(range(len(seqs)))
        self._n_tokens = valid.numel()

    def finish_padded(self, sequences: torch.Tensor | None) -> None:
        """End a padded ``generate`` call and release its rows.

        Args:
            sequences: ``generate``'s output ``[B, prompt + new]`` when it succeeded: the generated tokens
                are recorded so full blocks of prompt + answer enter the prefix cache (a follow-up turn
                reuses them). None after a failure: only steps that completed are kept.
        """
        if sequences is not None and self._meta is not None and len(self._layers_done) == len(self.layers):
            for b, p in enumerate(self._pads):
                self._seqs[b].tokens = sequences[b, p:].tolist()
            self._complete_step()
        self.release_all()
        self._pads = []
        self._columns = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns already processed (what ``generate`` slices its inputs by)."""
        return self._columns

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``tokens_to_remove`` columns of the batch (assisted decoding's rollback).
        Negative values keep that many columns, as in transformers."""
        self._finish_pending()
        keep = self._columns - tokens_to_remove if tokens_to_remove >= 0 else -tokens_to_remove
        self._columns = max(0, min(self._columns, keep))
        for b, p in enumerate(self._pads):
            self.blocks.truncate(self._seqs[b], max(0, self._columns - p), keep_tokens=False)

    def reset(self) -> None:
        """Release every row (the pool and its prefix cache stay)."""
        self.release_all()
        self._pads = []
        self._columns = 0
