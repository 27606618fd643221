"""The engine core: one step is schedule -> execute -> update, over a paged KV cache, with no threads or handles.

:class:`EngineCore` owns the model's side of continuous batching: the paged cache, the scheduler and the choice of
next tokens. Its forward is a :class:`~infopt.generate.Forward` it is given (``packed``: eager, or compiled by
:func:`infopt.compile.engine_forward`), the one every decode loop calls. Each :meth:`EngineCore.step` runs at most one forward and returns what
happened to each request as :class:`CoreEvent` values (a new token, a finish). The front-end
(:class:`~infopt.batching.Engine`) turns them into streams and results for request handles, applies stop strings
and cancellations, and runs the background thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..attention.backends import set_backend_
from ..attention.paged import PAGED_IMPL, load_cpu_kernel
from ..core.introspect import inspect_model, text_config
from ..generate import Forward
from ..generate.sampling import choose_tokens
from ..kvcache.paged import Paged
from ..kvcache.paged_cache import PagedCache
from ..kvcache.pool import num_blocks_for_budget
from .graphs import DecodeBuckets, DecodeGraphs
from .params import SamplingParams
from .scheduler import Scheduler, SeqState, SequenceTooLarge

__all__ = ["EngineCore", "CoreEvent", "DEFAULT_KV_BUDGET"]


DEFAULT_KV_BUDGET = 2**30
"""KV-cache bytes an engine's pool gets when ``kv.num_blocks`` is not given (1 GiB)."""


@dataclass
class CoreEvent:
    """What one step did to one request.

    Attributes:
        seq: the request.
        token: the token it gained (already appended to ``seq.output``), or None.
        finish: ``"length"``, ``"stop"`` (an EOS id) or ``"error"`` when the request ended this step (the core has
            released it), else None.
        error: the reason for ``"error"``.
    """

    seq: SeqState
    token: int | None = None
    finish: str | None = None
    error: str | None = None


class EngineCore:
    """Continuous batching's model side (module docstring). The arguments are :class:`~infopt.batching.Engine`'s,
    which documents them."""

    def __init__(self, model: nn.Module, forward: Forward | Callable[[], Forward] | None = None, *,
                 max_batch_tokens: int = 512, max_seqs: int = 64, kv: Paged | None = None, chunked_prefill: bool = True,
                 prefill_chunk: int | None = None, max_skips: int = 16, cuda_graphs: bool | str = "auto",
                 graph_batch_sizes: Sequence[int] | None = None):
        for name, v in (("max_batch_tokens", max_batch_tokens), ("max_seqs", max_seqs), ("max_skips", max_skips + 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"Engine {name}={v!r} is invalid; allowed: a positive integer")
        if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk <= 0):
            raise ValueError(f"Engine prefill_chunk={prefill_chunk!r} is invalid; allowed: a positive integer or None")
        if not (isinstance(cuda_graphs, bool) or cuda_graphs in ("auto", "replay")):
            raise ValueError(f"Engine cuda_graphs={cuda_graphs!r} is invalid; allowed: 'auto', True, False or 'replay'")
        kv = kv or Paged()
        if not isinstance(kv, Paged):
            raise ValueError(f"Engine kv={kv!r} is invalid; allowed: an infopt.kvcache.Paged config")
        info = inspect_model(model)
        kv.check(model, info, (kv,))
        if cuda_graphs is True and info.device.type != "cuda":
            raise ValueError(f"Engine cuda_graphs=True needs a model on a CUDA device; this one is on {info.device}. "
                             "Use cuda_graphs='auto' (graphs on CUDA only)")
        graphs = "cuda" if cuda_graphs is True or (cuda_graphs == "auto" and info.device.type == "cuda") else \
            "replay" if cuda_graphs == "replay" else None
        if model.config._attn_implementation != PAGED_IMPL:
            set_backend_(model, "paged", step="batching")
        # made once the arguments are checked and the attention switched (a refused engine leaves the model as it was)
        if forward is None:
            forward = Forward(model)
        self.forward: Forward = forward if isinstance(forward, Forward) else forward()
        self.model = model
        max_positions = getattr(text_config(model.config), "max_position_embeddings", None)
        num_blocks = kv.num_blocks
        if num_blocks is None:  # the budget, but no more than max_seqs full-length sequences need
            num_blocks = max(1, num_blocks_for_budget(model, DEFAULT_KV_BUDGET, kv.block_size))
            if max_positions:
                num_blocks = min(num_blocks, -(-max_seqs * max_positions // kv.block_size))
        self.cache = PagedCache.for_model(model, num_blocks, kv.block_size, prefix_caching=kv.prefix_caching,
                                          scratch_blocks=1 if graphs else 0)
        self.device = self.cache.device or torch.device("cpu")  # the model's: batches, logits, generators
        if self.device.type == "cpu":
            load_cpu_kernel()  # now, not in the first step: a compiled forward cannot load it while tracing
        self.scheduler = Scheduler(self.cache.blocks, max_seqs=max_seqs, max_batch_tokens=max_batch_tokens,
                                   chunked_prefill=chunked_prefill,
                                   prefill_chunk=prefill_chunk or min(max_batch_tokens, max(16, max_batch_tokens // 8)),
                                   max_skips=max_skips)
        self.capacity_tokens = num_blocks * kv.block_size
        self.max_positions = max_positions
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0]) \
            if model.get_output_embeddings() is not None else None
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        self.eos = tuple([eos] if isinstance(eos, int) else (eos or ()))
        self._logits_to_keep = self.forward.keeps
        self.graphs: DecodeGraphs | None = None
        if graphs:
            longest = min(self.capacity_tokens, max_positions or self.capacity_tokens)
            buckets = DecodeBuckets.for_engine(max_seqs, -(-longest // kv.block_size), kv.block_size,
                                               batch_sizes=graph_batch_sizes)
            self.graphs = DecodeGraphs(self._graph_forward, self.cache, buckets, backend=graphs,
                                       signature=lambda: tuple(p.data_ptr() for p in model.parameters()))
        self.stats: dict[str, Any] = {}
        self.reset_stats()

    def reset_stats(self) -> None:
        """Start the aggregate figures of :meth:`metrics` afresh (the scheduler's preemption count included)."""
        self.stats.clear()
        self.stats.update(steps=0, prefill_tokens=0, decode_tokens=0, finished=0, cancelled=0, errors=0, busy_s=0.0,
                          decode_steps=0, decode_busy_s=0.0, schedule_s=0.0, kv_util_sum=0.0, kv_util_max=0.0)
        self.scheduler.preemptions = 0

    # -- requests ------------------------------------------------------------------------------------
    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request this engine cannot serve (empty, ids outside the vocabulary, longer than
        the KV cache or the model's positions)."""
        if not ids:
            raise ValueError("empty prompt: a request needs at least one prompt token")
        if self.vocab_size is not None and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(t for t in ids if t < 0 or t >= self.vocab_size)
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        need = len(ids) + params.max_new_tokens
        if need > self.capacity_tokens:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {need} tokens exceeds the KV "
                f"cache ({self.capacity_tokens} tokens); shorten the request or build the engine with "
                "kv=Paged(num_blocks=...) large enough")
        if self.max_positions is not None and need > self.max_positions:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {need} exceeds "
                             f"the model's max_position_embeddings ({self.max_positions})")

    def add(self, seq: SeqState) -> None:
        """Queue a request for scheduling."""
        self.scheduler.add(seq)

    def requests(self) -> list[SeqState]:
        """Every request the core holds, running or waiting."""
        return [*self.scheduler.running, *self.scheduler.waiting]

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def finish(self, seq: SeqState, reason: str) -> None:
        """End a request (any reason, ``"cancelled"`` included): release its KV blocks and count it."""
        self.scheduler.drop(seq)
        seq.metrics.finished = time.perf_counter()
        seq.metrics.output_tokens = len(seq.output)
        self.stats[{"cancelled": "cancelled", "error": "errors"}.get(reason, "finished")] += 1

    # -- one step ------------------------------------------------------------------------------------
    @torch.inference_mode()  # about 1 ms less per step than no_grad on the default model; the KV pools are made
    # with inference_mode off (kvcache.pool), so paths outside the engine can still write them
    def step(self) -> list[CoreEvent]:
        """Schedule, execute (at most one forward), update; returns what happened to each request."""
        events: list[CoreEvent] = []
        t_schedule = time.perf_counter()
        scheduled = self._schedule(events)
        if scheduled is not None:
            plan, batch, key = scheduled
            t0 = time.perf_counter()
            self.stats["schedule_s"] += t0 - t_schedule
            executed = self._execute(plan, batch, events, key)
            if executed is not None:
                self._update(plan, *executed, t0, events)
        return events

    def _schedule(self, events: list[CoreEvent]) -> tuple[list[tuple[SeqState, int]], Any, tuple | None] | None:
        """The scheduler's next step (its blocks allocated), laid out in the paged cache's tensors (or, for a decode
        step a graph serves, in the graphs' buffers: the third item is its bucket); None when nothing runs."""
        try:
            step = self.scheduler.next_step()
        except SequenceTooLarge as e:  # one sequence larger than the pool: fail it, serve the rest
            self._fail(e.seq, f"out of KV blocks: {e}", events)
            return None
        if step is None:
            return None
        if self.graphs is not None:
            blocks = max(len(self.cache.blocks.seq(sid).blocks) for sid, _ in step.entries)
            key = self.graphs.key([n for _, n in step.plan], blocks)
            if key is not None:
                return step.plan, self.cache.layout_decode(step.entries, step.starts, self.graphs.buffers, *key), key
        return step.plan, self.cache.layout_step(step.entries, step.starts), None

    def _execute(self, plan: list[tuple[SeqState, int]], batch, events: list[CoreEvent], key: tuple | None = None
                 ) -> tuple[list[int], torch.Tensor] | None:
        """One packed forward (or a graph's replay, for a bucket ``key``); returns the plan rows whose next token is
        due and their logits, or None when the forward failed (the step is rolled back and its requests fail; the
        engine keeps serving the rest)."""
        due_rows = [i for i, (s, n) in enumerate(plan) if s.pending == n]
        try:
            if key is not None:  # every row's logits, padding included: the due ones are picked after
                self.cache.step_inputs()  # the forward writes every layer
                logits = self.graphs.run(key)
                self.graphs.stats.padded_rows += key[0] - len(plan)
                rows = logits[0, :len(plan)]
                return due_rows, rows if len(due_rows) == len(plan) else rows[due_rows]
            keep = batch.logits_indices[due_rows] if due_rows else batch.logits_indices[:1]
            logits = self._forward(batch, keep, self.cache.step_inputs())
        except Exception as e:
            self.cache.abort_step()
            self.scheduler.abort(plan)
            for seq, _ in plan:
                self._fail(seq, f"forward failed: {type(e).__name__}: {e}", events)
            return None
        logits = logits[0, :len(due_rows)] if self._logits_to_keep else logits[0, batch.logits_indices[due_rows]]
        return due_rows, logits

    def _forward(self, batch, keep: torch.Tensor, step) -> torch.Tensor:
        """The step's logits ``[1, rows, vocab]`` from the forward's packed step (eager until the first step has
        allocated the KV pools, which a compiled graph cannot do)."""
        return self.forward.packed(batch.input_ids, batch.position_ids, keep, step,
                                   eager=not self.cache.pool.allocated())

    def _graph_forward(self, input_ids, position_ids, keep, step) -> torch.Tensor:
        """The body a decode graph captures: the forward's packed step over the graphs' buffers."""
        return self.forward.packed(input_ids, position_ids, keep, step)

    def _update(self, plan: list[tuple[SeqState, int]], due_rows: list[int], logits: torch.Tensor, t0: float,
                events: list[CoreEvent]) -> None:
        """Record the finished forward: progress and metrics, the next token of each due sequence, stats."""
        decode_only = True
        for seq, n in plan:
            if seq.metrics.first_scheduled is None:
                seq.metrics.first_scheduled = t0
            prefill = n > 1 or seq.computed < len(seq.prompt)
            decode_only = decode_only and not prefill
            self.stats["prefill_tokens" if prefill else "decode_tokens"] += n
        self.cache.end_step()
        due = self.scheduler.complete(plan)
        if due:
            seqs = [plan[i][0] for i in due_rows]
            eos_masks = [s.eos if s.eos is not None and len(s.output) < s.params.min_new_tokens else None
                         for s in seqs]
            tokens = choose_tokens(logits, [s.params for s in seqs], [s.generator for s in seqs], eos_masks)
            now = time.perf_counter()
            for seq, tok in zip(seqs, tokens, strict=True):
                seq.output.append(tok)
                if seq.metrics.first_token is None:
                    seq.metrics.first_token = now
                if seq.eos is not None and tok in seq.eos:  # masked while under min_new_tokens
                    reason = "stop"
                elif len(seq.output) >= seq.params.max_new_tokens:
                    reason = "length"
                else:
                    reason = None
                if reason is not None:
                    self.finish(seq, reason)
                events.append(CoreEvent(seq, tok, reason))
        alloc = self.cache.allocator
        util = alloc.num_used / max(1, alloc.num_blocks)
        self.stats["steps"] += 1
        busy = time.perf_counter() - t0
        self.stats["busy_s"] += busy
        if decode_only:
            self.stats["decode_steps"] += 1
            self.stats["decode_busy_s"] += busy
        self.stats["kv_util_sum"] += util
        self.stats["kv_util_max"] = max(self.stats["kv_util_max"], util)

    def _fail(self, seq: SeqState, error: str, events: list[CoreEvent]) -> None:
        self.finish(seq, "error")
        events.append(CoreEvent(seq, None, "error", error))

    # -- metrics -------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """Aggregate figures: steps, tokens (prefill / decode), requests finished / cancelled / failed,
        preemptions, busy seconds (the forward and the token choice; ``decode_steps`` / ``decode_busy_s``: the
        steps of one new token per sequence, the rest hold prompt tokens; ``schedule_s``: scheduling and laying
        out the steps, host work before each forward) and tokens per busy second, KV block utilization (mean and
        max fraction of the pool in use per step) and the pool's block counts."""
        s = dict(self.stats)
        steps = max(1, s["steps"])
        s["kv_util_mean"] = s.pop("kv_util_sum") / steps
        s["preemptions"] = self.scheduler.preemptions
        s["tokens_per_busy_s"] = (s["prefill_tokens"] + s["decode_tokens"]) / s["busy_s"] if s["busy_s"] else 0.0
        s["kv_blocks"] = self.cache.allocator.stats()
        stats = getattr(self.forward, "stats", None)
        if stats is not None:
            s["compile"] = stats.as_dict()
        if self.graphs is not None:
            s["cuda_graphs"] = self.graphs.stats.as_dict()
        return s
