"""Fixed device buffers for decode steps replayed as CUDA graphs: a step's tokens, positions, slots, key lengths and
block tables live at the same addresses from step to step, and each step's values arrive in one copy.

A captured graph reads its inputs from the addresses it saw at capture, so a decode step cannot hand the forward new
tensors: :meth:`DecodeBuffers.stage` writes the step into these buffers instead. All fields are views of one int64
device tensor, filled from one host staging tensor (pinned on CUDA) by a single non-blocking copy. A step of ``S``
sequences runs in a bucket of ``B >= S`` rows and ``W`` block-table columns; the ``B - S`` padding rows decode token
0 at position 0 into the pool's scratch block (:attr:`infopt.kvcache.pool.KVBlockPool.scratch_block`), attending to
that one slot, so they touch no sequence's keys, and every other op of a decoder is row-wise, so the real rows are
unaffected. :meth:`DecodeBuffers.meta` is the paged attention metadata over the buffers, one object per bucket.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..attention.paged import PagedAttentionMetadata

__all__ = ["DecodeBuffers"]


class DecodeBuffers:
    """Static inputs of decode steps of up to ``max_seqs`` rows and ``max_blocks`` block-table columns.

    Args:
        max_seqs: rows of the largest bucket.
        max_blocks: block-table columns of the widest bucket.
        block_size: the pool's token slots per block.
        scratch_block: the pool's scratch block id (padding rows write and read there).
        device: the model's device.

    Attributes:
        input_ids, positions, slots, kv_lens: ``[max_seqs]`` int64 views.
        rows: ``[max_seqs]`` ``0, 1, ...`` (the logits to keep, and the query layout of a decode step).

    A bucket's block table is :meth:`table` ``(b, w)``: the first ``b * w`` slots of one region viewed as a
    contiguous ``[b, w]`` (the kernels take contiguous tables), so buckets share the region, each step writing its own.

    Example:
        >>> buffers = DecodeBuffers(4, 3, block_size=16, scratch_block=9, device="cpu")
        >>> buffers.stage([5, 6], [17, 3], [[0, 1], [2]], b=4, w=2)
        >>> buffers.input_ids.tolist(), buffers.kv_lens.tolist(), buffers.slots.tolist()
        ([5, 6, 0, 0], [18, 4, 1, 1], [17, 35, 144, 144])
        >>> buffers.table(4, 2).tolist()
        [[0, 1], [2, 9], [9, 9], [9, 9]]
    """

    def __init__(self, max_seqs: int, max_blocks: int, *, block_size: int, scratch_block: int,
                 device: torch.device | str):
        self.max_seqs, self.max_blocks, self.block_size = max_seqs, max_blocks, block_size
        self.scratch_block = scratch_block
        self.device = torch.device(device)
        n = max_seqs
        size = 4 * n + n * max_blocks
        self.data = torch.zeros(size, dtype=torch.long, device=self.device)
        self._staging = torch.zeros(size, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self.input_ids, self.positions, self.slots, self.kv_lens = (self.data[i * n:(i + 1) * n] for i in range(4))
        self._tables = self.data[4 * n:]
        self.rows = torch.arange(n, device=self.device)
        self._ones = torch.ones(n, dtype=torch.long, device=self.device)
        self._starts = torch.arange(n + 1, device=self.device)
        self._tiles = torch.stack([torch.arange(n), torch.zeros(n, dtype=torch.long)], 1).to(torch.int32).to(
            self.device)  # the Triton kernels' programs: row i is sequence i's one token
        self._metas: dict[tuple[int, int], PagedAttentionMetadata] = {}

    def table(self, b: int, w: int) -> torch.Tensor:
        """The ``[b, w]`` block table of bucket ``(b, w)``, contiguous (a view of the buffers)."""
        return self._tables[:b * w].view(b, w)

    def meta(self, b: int, w: int) -> PagedAttentionMetadata:
        """The paged attention metadata of a ``(b, w)`` bucket: views of the buffers (the same object each step)."""
        key = (b, w)
        if key not in self._metas:
            self._metas[key] = PagedAttentionMetadata(
                block_size=self.block_size, block_table=self.table(b, w), kv_lens=self.kv_lens[:b],
                query_pos=self.positions[:b, None], mask=None, gather=self.rows[:b, None], scatter=self.rows[:b],
                token_index=None, new_lens=self._ones[:b], single=None, decode=True, max_new=1,
                max_kv=w * self.block_size, _starts=self._starts[:b + 1], _tiles=self._tiles[:b])
        return self._metas[key]

    @torch.inference_mode()  # the engine makes its buffers in inference mode (DecodeGraphs), as its steps' tensors
    def stage(self, tokens: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]], *, b: int,
              w: int) -> None:
        """Write one decode step into the buffers: sequence ``i`` decodes ``tokens[i]`` at ``positions[i]`` (its key
        length becomes ``positions[i] + 1``) through the blocks ``tables[i]``; rows ``len(tokens)`` to ``b`` are
        padding. One copy to the device, ordered on the current stream before whatever reads the buffers next.

        Raises:
            ValueError: more rows than ``b``, a bucket past the buffers, or a table longer than ``w``.
        """
        s = len(tokens)
        if not (s <= b <= self.max_seqs and 0 < w <= self.max_blocks):
            raise ValueError(f"a decode step of {s} rows cannot run in bucket (b={b}, w={w}) of buffers sized "
                             f"({self.max_seqs}, {self.max_blocks})")
        n, bs, scratch = self.max_seqs, self.block_size, self.scratch_block
        host = self._staging
        table = host[4 * n:4 * n + b * w].view(b, w)
        table.fill_(scratch)
        for i, blocks in enumerate(tables):
            if len(blocks) > w:
                raise ValueError(f"row {i} needs {len(blocks)} blocks; the bucket has {w}")
            if blocks:
                table[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        pad = b - s
        pos = torch.tensor(list(positions) + [0] * pad, dtype=torch.long)
        host[:b] = torch.tensor(list(tokens) + [0] * pad, dtype=torch.long)
        host[n:n + b] = pos
        rows = torch.arange(b)
        host[2 * n:2 * n + b] = table[rows, pos // bs] * bs + pos % bs
        host[3 * n:3 * n + b] = pos + 1
        self.data.copy_(host, non_blocking=True)
