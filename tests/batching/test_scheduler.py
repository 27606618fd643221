"""Scheduler invariants (hypothesis): budgets and limits hold every step, every request completes with its exact
token count, preempted requests resume, and the block pool ends empty. The scheduler runs on a pure-Python
KVBlockManager: no model, no tensors (each 'forward' is the scheduler's complete() with made-up next tokens)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infopt.batching.params import RequestMetrics, SamplingParams
from infopt.batching.scheduler import Scheduler, SeqState, SequenceTooLarge
from infopt.kvcache.blocks import BlockAllocator
from infopt.kvcache.manager import KVBlockManager


def _kv(num_blocks: int, block_size: int) -> KVBlockManager:
    return KVBlockManager(BlockAllocator(num_blocks, block_size), block_size)

requests = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=14)


def _drive(sched: Scheduler, seqs: list[SeqState], budget: int, max_seqs: int) -> int:
    steps = 0
    done: set[int] = set()
    while sched.has_work():
        step = sched.next_step()
        assert step is not None, "work remains but nothing could be scheduled (deadlock)"
        plan = step.plan
        steps += 1
        assert steps < 5000
        assert step.num_tokens <= max(budget, max(n for _, n in plan))
        assert len(sched.running) <= max_seqs
        assert len({s.rid for s, _ in plan}) == len(plan)
        for (s, n), (rid, toks), start in zip(plan, step.entries, step.starts, strict=True):
            # the tokens fed are exactly the not-yet-computed ones, and the blocks hold them
            assert rid == s.rid and toks == s.all_tokens()[s.computed:s.computed + n] and start == s.computed
            assert sched.kv.seq_len(rid) == start + n
            assert len(sched.kv.block_table(rid)) * sched.kv.block_size >= start + n
        for seq in sched.complete(plan):
            seq.output.append(7 + len(seq.output))  # a made-up next token
            if len(seq.output) == seq.params.max_new_tokens:
                sched.drop(seq)
                done.add(seq.rid)
        sched.kv.allocator.check_invariants()
    assert done == {s.rid for s in seqs}
    return steps


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests, budget=st.integers(4, 64), max_seqs=st.integers(1, 6), block_size=st.sampled_from([2, 4, 8]),
       chunked=st.booleans(), spare=st.integers(0, 8))
def test_every_request_completes_within_limits(reqs, budget, max_seqs, block_size, chunked, spare):
    longest = max(p + n for p, n, _ in reqs)
    num_blocks = -(-longest // block_size) + 1 + spare  # always room for the longest alone
    kv = _kv(num_blocks, block_size)
    sched = Scheduler(kv, max_seqs=max_seqs, max_batch_tokens=budget, chunked_prefill=chunked,
                      prefill_chunk=max(1, budget // 2))
    seqs = []
    for i, (plen, new, shared) in enumerate(reqs):
        prompt = [100 + shared] * min(plen, 8) + [200 + i] * max(0, plen - 8)  # some prefixes shared
        seq = SeqState(i, prompt, SamplingParams(max_new_tokens=new), RequestMetrics(0.0))
        sched.add(seq)
        seqs.append(seq)
    _drive(sched, seqs, budget, max_seqs)
    assert kv.allocator.num_used == 0 and not kv.seqs
    assert all(len(s.output) == s.params.max_new_tokens for s in seqs)


def test_preemption_puts_the_newest_back_first_and_it_resumes():
    kv = _kv(6, 4)  # 24 tokens
    sched = Scheduler(kv, max_seqs=4, max_batch_tokens=64)
    a = SeqState(0, list(range(1, 9)), SamplingParams(max_new_tokens=8), RequestMetrics(0.0))
    b = SeqState(1, list(range(20, 28)), SamplingParams(max_new_tokens=8), RequestMetrics(0.0))
    sched.add(a)
    sched.add(b)
    steps = _drive(sched, [a, b], 64, 4)
    assert b.metrics.preemptions >= 1 and a.metrics.preemptions == 0  # the older one always progresses
    assert sched.preemptions >= 1 and steps > 8


def test_starvation_bound_stops_later_requests_passing_the_head():
    kv = _kv(8, 4)  # 32 tokens
    sched = Scheduler(kv, max_seqs=8, max_batch_tokens=64, max_skips=2)
    hog = SeqState(0, list(range(1, 17)), SamplingParams(max_new_tokens=8), RequestMetrics(0.0))  # 6 blocks
    sched.add(hog)
    sched.next_step()  # hog admitted and prefilled
    sched.complete([(hog, 16)])
    hog.output.append(1)
    big = SeqState(1, list(range(40, 56)), SamplingParams(max_new_tokens=4), RequestMetrics(0.0))  # does not fit yet
    sched.add(big)
    smalls = [SeqState(2 + i, [90 + i], SamplingParams(max_new_tokens=1), RequestMetrics(0.0)) for i in range(6)]
    for s in smalls:
        sched.add(s)
    admitted_small = 0
    for _ in range(6):
        plan = sched.next_step().plan
        admitted_small += sum(1 for s, _ in plan if s in smalls and s.computed == 0)
        for seq in sched.complete(plan):
            seq.output.append(1)
            if len(seq.output) >= seq.params.max_new_tokens:
                sched.drop(seq)
    assert big.skips == 2
    assert admitted_small == 2  # two passed the head, then admission waited for it


@pytest.mark.parametrize("chunked", [True, False])
def test_a_request_larger_than_the_pool_is_named_not_deadlocked(chunked):
    kv = _kv(2, 4)
    sched = Scheduler(kv, max_seqs=2, max_batch_tokens=4, chunked_prefill=chunked)
    big = SeqState(0, list(range(1, 20)), SamplingParams(max_new_tokens=2), RequestMetrics(0.0))
    sched.add(big)
    with pytest.raises(SequenceTooLarge) as e:
        while True:
            nxt = sched.next_step()
            assert nxt is not None
            for seq in sched.complete(nxt.plan):
                seq.output.append(1)
    assert e.value.seq is big
