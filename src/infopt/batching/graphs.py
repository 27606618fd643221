"""The batching engine's decode steps as CUDA graphs, one per bucket of batch size and block-table width.

A decode-shaped step (every scheduled sequence computes one new token) of ``S`` sequences whose longest needs ``nb``
blocks runs in the smallest bucket ``(B, W)`` with ``B >= S`` and ``W >= nb``: the paged cache writes it into fixed
buffers (:class:`~infopt.kvcache.decode_buffers.DecodeBuffers`, padding rows parked on the pool's scratch block) and
the bucket's graph replays the forward captured over those buffers, one launch for the whole step instead of one per
kernel, with no value read back to the host inside it (the paged attention's decode path,
:func:`infopt.ops.paged_attention.decode_sdpa`). Other steps (prefill, mixed, larger than every bucket) run the
forward as before. Widths are bucketed because the reference attention's cost follows the table's width.

Graphs are captured on a bucket's first step, or all at once by :meth:`DecodeGraphs.capture` (the engine's
``warmup``). A replay bakes in the addresses of the weights and the KV pools, so :meth:`DecodeGraphs.run` checks both
and recaptures once when either changed. ``backend="replay"`` is the same machinery on any device without graphs: the
captured body is called again over the same buffers (what the CPU tests run, so the layout, padding and bucket logic
a GPU replays are checked everywhere).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from ..attention.paged import PagedStep
from ..kvcache.decode_buffers import DecodeBuffers

__all__ = ["DEFAULT_BATCH_SIZES", "DecodeBuckets", "GraphStats", "DecodeGraphs", "BACKENDS"]

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
"""Batch buckets before ``max_seqs`` cuts them (powers of two, then steps of a half)."""

WIDTH_TOKENS = (256, 1024, 4096)
"""Block-table widths, in tokens, below the engine's widest (which is always a bucket)."""

BACKENDS = ("cuda", "replay")


@dataclass(frozen=True)
class DecodeBuckets:
    """The ``(batch, width)`` buckets graphs are kept for.

    Example:
        >>> buckets = DecodeBuckets.for_engine(max_seqs=12, max_blocks=100, block_size=16)
        >>> buckets.batch_sizes, buckets.widths
        ((1, 2, 4, 8, 12), (16, 64, 100))
        >>> buckets.pick(3, 20), buckets.pick(13, 1), buckets.pick(2, 101)
        ((4, 64), None, None)
    """

    batch_sizes: tuple[int, ...]
    widths: tuple[int, ...]

    @classmethod
    def for_engine(cls, max_seqs: int, max_blocks: int, block_size: int, *,
                   batch_sizes: Sequence[int] | None = None) -> DecodeBuckets:
        """Buckets for an engine of ``max_seqs`` sequences whose longest holds ``max_blocks`` blocks: the batch
        sizes (default :data:`DEFAULT_BATCH_SIZES`) up to ``max_seqs``, which is always one; widths of
        :data:`WIDTH_TOKENS` below ``max_blocks``, which is always one.

        Raises:
            ValueError: a batch size that is not a positive integer.
        """
        sizes = DEFAULT_BATCH_SIZES if batch_sizes is None else tuple(batch_sizes)
        if any(not isinstance(b, int) or isinstance(b, bool) or b <= 0 for b in sizes):
            raise ValueError(f"graph batch sizes {sizes!r} are invalid; allowed: positive integers")
        b = sorted({s for s in sizes if s < max_seqs} | {max_seqs})
        w = sorted({-(-t // block_size) for t in WIDTH_TOKENS if -(-t // block_size) < max_blocks} | {max_blocks})
        return cls(tuple(b), tuple(w))

    def pick(self, seqs: int, blocks: int) -> tuple[int, int] | None:
        """The smallest bucket holding ``seqs`` rows of at most ``blocks`` blocks; None when none does."""
        b = next((x for x in self.batch_sizes if x >= seqs), None)
        w = next((x for x in self.widths if x >= blocks), None)
        return None if b is None or w is None else (b, w)


@dataclass
class GraphStats:
    """What the decode graphs did (``Engine.metrics()["cuda_graphs"]``).

    Attributes:
        backend: ``"cuda"`` (graphs) or ``"replay"`` (the body called again: the CPU twin).
        buckets: the ``(batch, width)`` buckets graphs may be captured for.
        captured: the buckets captured so far, as ``"BxW"``.
        capture_s: seconds spent capturing (warm-up calls included).
        replays: steps served by a graph.
        served: those steps per bucket (``"BxW"`` -> count), in the order the buckets were first used.
        padded_rows: padding rows those steps computed.
        recaptures: times every graph was dropped because the weights or pools moved.
        disabled: why graphs were turned off for good (a failed capture), or None.
    """

    backend: str
    buckets: list[str] = field(default_factory=list)
    captured: list[str] = field(default_factory=list)
    capture_s: float = 0.0
    replays: int = 0
    served: dict[str, int] = field(default_factory=dict)
    padded_rows: int = 0
    recaptures: int = 0
    disabled: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
                for k, v in self.__dict__.items()}


class DecodeGraphs:
    """Decode steps replayed per bucket (module docstring) for one engine.

    Args:
        run_forward: ``(input_ids, position_ids, keep, paged_step) -> logits [1, rows, V]``, the engine's forward.
        cache: the engine's :class:`~infopt.kvcache.PagedCache`, its pool built with a scratch block.
        buckets: the buckets (:meth:`DecodeBuckets.for_engine`).
        backend: ``"cuda"`` or ``"replay"``.
        signature: a function returning what a replay depends on besides the pools (the weights' addresses).

    Raises:
        ValueError: an unknown backend, ``"cuda"`` off a CUDA device, or a pool without a scratch block.
    """

    def __init__(self, run_forward: Callable[..., torch.Tensor], cache, buckets: DecodeBuckets, *,
                 backend: str = "cuda", signature: Callable[[], Any] | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"decode graph backend {backend!r} is invalid; allowed: {', '.join(BACKENDS)}")
        device = cache.device or torch.device("cpu")
        if backend == "cuda" and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a model on a CUDA device; this one is on {device}")
        if cache.pool.scratch_block is None:
            raise ValueError("decode graphs need a pool built with scratch_blocks=1")
        self.run_forward, self.cache, self.buckets, self.backend = run_forward, cache, buckets, backend
        self.signature = signature or (lambda: None)
        with torch.inference_mode():  # as the engine's steps make theirs: a compiled step guards on the difference
            self.buffers = DecodeBuffers(max(buckets.batch_sizes), max(buckets.widths), block_size=cache.block_size,
                                         scratch_block=cache.pool.scratch_block, device=device)
        self.stats = GraphStats(backend, buckets=[f"{b}x{w}" for b in buckets.batch_sizes for w in buckets.widths])
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor | None]] = {}
        self._mem_pool = None
        self._baked: tuple | None = None

    @property
    def enabled(self) -> bool:
        return self.stats.disabled is None

    def key(self, news: Sequence[int], blocks: int) -> tuple[int, int] | None:
        """The bucket of a step whose sequences compute ``news`` tokens each, the longest holding ``blocks`` blocks;
        None when the step is not decode-shaped, fits no bucket, or graphs are off (or the pools do not exist yet)."""
        if not self.enabled or not news or any(n != 1 for n in news) or not self.cache.pool.allocated():
            return None
        return self.buckets.pick(len(news), blocks)

    def _body(self, b: int, w: int) -> torch.Tensor:
        buf = self.buffers
        step = PagedStep(self.cache.pool, buf.meta(b, w), buf.slots[:b])
        return self.run_forward(buf.input_ids[None, :b], buf.positions[None, :b], buf.rows[:b], step)

    def _where(self) -> tuple:
        pool = self.cache.pool
        return (self.signature(), tuple(t.data_ptr() for t in (*pool.keys, *pool.values)))

    def run(self, key: tuple[int, int]) -> torch.Tensor:
        """The logits ``[1, b, V]`` of the step laid out in the buffers for bucket ``key`` (valid until the next
        replay: the caller consumes them first)."""
        where = self._where()
        if self._baked is not None and where != self._baked:
            self.invalidate("the weights or the KV pools moved")
            self.stats.recaptures += 1
        self._baked = where
        if key not in self._graphs:
            try:
                self._capture(key)
            except Exception as e:  # this step runs uncaptured over the same buffers; later ones as before
                self.disable(f"capture failed: {type(e).__name__}: {e}")
                return self._body(*key)
        graph, out = self._graphs[key]
        b = key[0]
        self.stats.replays += 1
        name = f"{b}x{key[1]}"
        self.stats.served[name] = self.stats.served.get(name, 0) + 1
        if self.backend == "replay":
            return self._body(*key)
        graph.replay()
        return out[:, :b] if out.shape[1] > b else out

    def _capture(self, key: tuple[int, int]) -> None:
        t0 = time.perf_counter()
        if self.backend == "replay":
            self._graphs[key] = (None, None)
        else:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # the warm-up: lazy inits, allocator pools, autotuning happen here
                self._body(*key)
            torch.cuda.current_stream().wait_stream(side)
            if self._mem_pool is None:
                self._mem_pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._mem_pool):
                out = self._body(*key)
            self._graphs[key] = (graph, out)
        self.stats.captured.append(f"{key[0]}x{key[1]}")
        self.stats.capture_s += time.perf_counter() - t0

    @torch.inference_mode()
    def capture(self, keys: Sequence[tuple[int, int]] | None = None) -> None:
        """Capture the buckets ``keys`` (default: every bucket) now, the largest first so the smaller graphs reuse its
        memory. The buffers hold an all-padding step while capturing (only the scratch block is written). The KV
        pools must exist (after the engine's first step)."""
        if not self.cache.pool.allocated():
            raise RuntimeError("capture the decode graphs after the first step has allocated the KV pools")
        todo = sorted(keys or [(b, w) for b in self.buckets.batch_sizes for w in self.buckets.widths], reverse=True)
        todo = [key for key in todo if key not in self._graphs]
        self._baked = self._where()
        for b, w in tqdm(todo, desc="infopt batching: capturing the decode steps' CUDA graphs", unit="graph",
                         disable=not todo):
            self.buffers.stage([], [], [], b=b, w=w)
            self._capture((b, w))

    def disable(self, reason: str) -> None:
        """Turn graphs off for good (the engine runs every step as before) and say why in the stats."""
        self.invalidate(reason)
        self.stats.disabled = reason
        log.warning("infopt batching: CUDA-graph decode steps are off: %s", reason)

    def invalidate(self, reason: str) -> None:
        """Drop every captured graph (they are captured again on use)."""
        self._graphs.clear()
        self.stats.captured.clear()
        log.info("infopt batching: decode graphs dropped: %s", reason)

    def close(self) -> None:
        """Release the graphs and their memory pool."""
        self._graphs.clear()
        self._mem_pool = None
