"""Iteration-level scheduling over a paged KV cache: which sequences, and how many tokens of each, run next step.

Each step has a token budget (``max_batch_tokens``). Running sequences are served first: every
decoding sequence contributes its one new token, then sequences still in prefill continue with a
chunk of their prompt. Waiting requests are admitted first come, first served while the sequence
limit, the budget and the free KV blocks allow. A request whose first chunk does not fit may be
passed by later, smaller ones at most ``max_skips`` times; after that admission waits for it
(the starvation bound). When a step needs more KV blocks than the pool has, the most recently
admitted sequence is preempted: its blocks are released and it goes back to the head of the queue,
to be recomputed (its full blocks usually still sit in the prefix cache) when blocks free up.

The scheduler works on a :class:`~infopt.kvcache.manager.KVBlockManager` (the blocks each sequence holds, in pure
Python) and hands out :class:`ScheduledStep` plans; laying a plan out in tensors is the cache's job
(:meth:`~infopt.kvcache.PagedCache.layout_step`), so scheduling runs, and is tested, with no model.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..kvcache.blocks import OutOfBlocks
from ..kvcache.manager import KVBlockManager
from .params import RequestMetrics, SamplingParams

if TYPE_CHECKING:
    import torch

__all__ = ["Scheduler", "SeqState", "ScheduledStep", "SequenceTooLarge"]


class SequenceTooLarge(OutOfBlocks):
    """One sequence needs more KV blocks than the whole pool holds; ``seq`` is the request to fail."""

    def __init__(self, message: str, seq: SeqState):
        super().__init__(message)
        self.seq = seq


@dataclass(eq=False)
class SeqState:
    """One request's decoding state inside the engine.

    Attributes:
        rid: request id (also its sequence id in the cache while admitted).
        prompt: prompt token ids. output: generated ids so far.
        params: its :class:`SamplingParams`.
        computed: leading tokens of ``prompt + output`` whose K/V are in the cache.
        admitted: True while it holds a sequence in the cache.
        skips: times a later request was admitted ahead of it.
        generator: a sampled request's generator, on the model's device. eos: its end-of-sequence ids
            (None: ``ignore_eos`` or none known).
    """

    rid: int
    prompt: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    output: list[int] = field(default_factory=list)
    computed: int = 0
    admitted: bool = False
    skips: int = 0
    generator: torch.Generator | None = None
    eos: tuple[int, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def pending(self) -> int:
        """Tokens known but not yet in the cache (the rest of the prompt, or the last sampled token)."""
        return self.total - self.computed

    def tokens(self, start: int, n: int) -> list[int]:
        p = len(self.prompt)
        if start >= p:
            return self.output[start - p:start - p + n]
        head = self.prompt[start:start + n]
        return head + self.output[:n - len(head)] if len(head) < n else head

    def all_tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class ScheduledStep:
    """One planned step, its KV blocks already allocated.

    Attributes:
        plan: each scheduled sequence with the tokens it runs this step (decoders first).
        entries: ``(rid, token ids)`` per plan row: what the forward feeds.
        starts: each row's position before the step (its first new token's position).
    """

    plan: list[tuple[SeqState, int]]
    entries: list[tuple[int, list[int]]]
    starts: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.plan)


class Scheduler:
    """Plans each step and keeps the waiting and running queues.

    Args:
        kv: the block manager of the engine's paged cache (``PagedCache.blocks``).
        max_seqs: sequences in the running set at most.
        max_batch_tokens: tokens per forward at most (decode tokens plus prefill chunks).
        chunked_prefill: split prompts longer than the step's budget across steps, interleaved with
            decoding; off, a prompt is prefilled in one step (alone, when it exceeds the budget).
        prefill_chunk: the most prompt tokens one sequence gets per step (None: the whole budget), so a
            long prompt leaves room for newcomers' prefills in the same step.
        max_skips: how many later requests may be admitted ahead of a waiting one that does not fit.
        watermark_blocks: free blocks kept back at admission for running sequences' growth.

    Example:
        >>> from infopt.kvcache.blocks import BlockAllocator
        >>> s = Scheduler(KVBlockManager(BlockAllocator(16, 16), 16), max_seqs=4, max_batch_tokens=8)
        >>> s.add(SeqState(0, list(range(1, 13)), SamplingParams(), RequestMetrics(0.0)))
        >>> step = s.next_step()
        >>> [(r.rid, n) for r, n in step.plan], step.starts  # a 12-token prompt, chunked to the 8-token budget
        ([(0, 8)], [0])
    """

    def __init__(self, kv: KVBlockManager, *, max_seqs: int, max_batch_tokens: int, chunked_prefill: bool = True,
                 prefill_chunk: int | None = None, max_skips: int = 16, watermark_blocks: int = 0):
        self.kv = kv
        self.max_seqs = max_seqs
        self.max_batch_tokens = max_batch_tokens
        self.chunked_prefill = chunked_prefill
        self.prefill_chunk = prefill_chunk or max_batch_tokens
        self.max_skips = max_skips
        self.watermark_blocks = watermark_blocks
        self.lookahead = 8  # waiting requests tried past ones that did not fit, per step
        self.waiting: deque[SeqState] = deque()
        self.running: list[SeqState] = []
        self.preemptions = 0
        self._admitted_now: list[SeqState] = []

    # -- queues ----------------------------------------------------------------------------------
    def add(self, seq: SeqState) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def drop(self, seq: SeqState) -> None:
        """Remove a request wherever it is (finished, cancelled or failed), releasing its KV blocks."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self._release(seq)

    def _release(self, seq: SeqState) -> None:
        if seq.admitted:
            self.kv.release(seq.rid)
            seq.admitted = False
        seq.computed = 0

    def preempt(self, seq: SeqState) -> None:
        """Drop ``seq``'s KV and put it back at the head of the queue for recomputation."""
        self.running.remove(seq)
        self._release(seq)
        seq.metrics.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    # -- planning ----------------------------------------------------------------------------------
    def _chunk(self, seq: SeqState, budget: int, alone: bool) -> int:
        pending = seq.pending
        if pending <= 1:
            return min(pending, budget)
        if self.chunked_prefill:
            return min(pending, budget, self.prefill_chunk)
        # whole prompts only; one longer than the budget runs by itself
        return pending if pending <= budget or alone else 0

    def _plan(self) -> list[tuple[SeqState, int]]:
        budget = self.max_batch_tokens
        plan: list[tuple[SeqState, int]] = []
        # running: decoders first (one token each), then sequences still in prefill
        for seq in sorted(self.running, key=lambda s: s.pending > 1):
            n = self._chunk(seq, budget, alone=not plan)
            if n <= 0:
                continue
            plan.append((seq, n))
            budget -= n
        reserved = sum(self.kv.blocks_needed(s.rid, n) for s, n in plan) + self.watermark_blocks
        self._admitted_now = []
        blocked: SeqState | None = None  # the first waiting request that did not fit
        misses = 0
        i = 0
        while i < len(self.waiting) and len(self.running) < self.max_seqs and budget > 0:
            if blocked is not None and (blocked.skips >= self.max_skips or misses > self.lookahead):
                break  # it has been passed often enough (admission waits for it), or the pool is simply full
            seq = self.waiting[i]
            cached = self.kv.add_sequence(seq.rid, seq.all_tokens())
            seq.admitted, seq.computed = True, cached
            n = self._chunk(seq, budget, alone=not plan)
            need = self.kv.blocks_needed(seq.rid, n) if n > 0 else 0
            if n <= 0 or need + reserved > self.kv.allocator.num_available:
                self._release(seq)
                blocked = blocked or seq
                misses += 1
                i += 1
                continue
            del self.waiting[i]
            if blocked is not None:
                blocked.skips += 1
            if seq.metrics.preemptions == 0:
                seq.metrics.cached_tokens = cached
            self.running.append(seq)
            self._admitted_now.append(seq)
            plan.append((seq, n))
            budget -= n
            reserved += need
        return plan

    def next_step(self) -> ScheduledStep | None:
        """Plan the next forward and allocate its KV blocks.

        Returns:
            The :class:`ScheduledStep`, or None when nothing can run.

        Raises:
            SequenceTooLarge: a single sequence needs more blocks than the whole pool holds (the engine fails it).
        """
        for _ in range(len(self.running) + len(self.waiting) + 2):
            plan = self._plan()
            if not plan:
                if self.waiting and not self.running:  # the whole pool is free and the head still does not fit
                    head = self.waiting[0]
                    raise SequenceTooLarge(f"request {head.rid} needs more KV blocks than the pool's "
                                           f"{self.kv.allocator.num_blocks}", head)
                return None
            entries = [(s.rid, s.tokens(s.computed, n)) for s, n in plan]
            starts = self.kv.allocate(entries)
            if starts is None:  # the pool cannot provide the step's blocks
                if len(self.running) <= 1:
                    raise SequenceTooLarge(f"the step needs {self.kv.blocks_needed_for(entries)} KV blocks, more "
                                           f"than the pool's {self.kv.allocator.num_blocks}", self.running[0])
                victim = self.running[-1]  # the newest sequence gives its blocks back
                if victim in self._admitted_now:  # admitted by this plan: back to the queue, not a preemption
                    self.running.remove(victim)
                    self._release(victim)
                    self.waiting.appendleft(victim)
                else:
                    self.preempt(victim)
                continue
            return ScheduledStep(plan, entries, starts)
        raise RuntimeError("the scheduler could not lay out a step after preempting every sequence; "
                           "admission and the cache disagree on the blocks a step needs (a bug: please report it)")

    def complete(self, plan: list[tuple[SeqState, int]]) -> list[SeqState]:
        """Record a finished forward (its blocks become shareable and enter the prefix cache); returns the sequences
        whose next token is due (every known token computed)."""
        self.kv.complete([s.rid for s, _ in plan])
        due = []
        for seq, n in plan:
            seq.computed += n
            if seq.pending == 0:
                due.append(seq)
        return due

    def abort(self, plan: list[tuple[SeqState, int]]) -> None:
        """The forward failed: its sequences' blocks go back to before the step."""
        self.kv.abort([s.rid for s, _ in plan])
