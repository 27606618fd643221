"""Scheduler invariants (hypothesis): budgets and limits hold every step, every request completes with its exact
token count, preempted requests resume, and the block pool ends empty. Steps are laid out in a real PagedCache;
no model runs (the 'forward' is begin_step + end_step with made-up next tokens)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infopt.attention import set_backend_
from infopt.batching.params import RequestMetrics, SamplingParams
from infopt.batching.scheduler import Scheduler, SeqState, SequenceTooLarge
from infopt.kvcache import PagedCache
from infopt.models import tiny_model

_MODEL = set_backend_(tiny_model(), "paged")

requests = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=14)


def _drive(sched: Scheduler, seqs: list[SeqState], budget: int, max_seqs: int) -> int:
    steps = 0
    done: set[int] = set()
    while sched.has_work():
        nxt = sched.next_step()
        assert nxt is not None, "work remains but nothing could be scheduled (deadlock)"
        plan, batch = nxt
        steps += 1
        assert steps < 5000
        assert batch.num_tokens == sum(n for _, n in plan) <= max(budget, max(n for _, n in plan))
        assert len(sched.running) <= max_seqs
        assert len({s.rid for s, _ in plan}) == len(plan)
        for s, n in plan:  # the tokens fed are exactly the not-yet-computed ones
            assert list(batch.input_ids[0, sum(m for _, m in plan[:plan.index((s, n))]):][:n]) == \
                s.all_tokens()[s.computed:s.computed + n]
        for seq in sched.complete(plan):
            seq.output.append(7 + len(seq.output))  # a made-up next token
            if len(seq.output) == seq.params.max_new_tokens:
                sched.drop(seq)
                done.add(seq.rid)
        sched.cache.allocator.check_invariants()
    assert done == {s.rid for s in seqs}
    return steps


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests, budget=st.integers(4, 64), max_seqs=st.integers(1, 6), block_size=st.sampled_from([2, 4, 8]),
       chunked=st.booleans(), spare=st.integers(0, 8))
def test_every_request_completes_within_limits(reqs, budget, max_seqs, block_size, chunked, spare):
    longest = max(p + n for p, n, _ in reqs)
    num_blocks = -(-longest // block_size) + 1 + spare  # always room for the longest alone
    cache = PagedCache.for_model(_MODEL, num_blocks, block_size)
    sched = Scheduler(cache, max_seqs=max_seqs, max_batch_tokens=budget, chunked_prefill=chunked,
                      prefill_chunk=max(1, budget // 2))
    seqs = []
    for i, (plen, new, shared) in enumerate(reqs):
        prompt = [100 + shared] * min(plen, 8) + [200 + i] * max(0, plen - 8)  # some prefixes shared
        seq = SeqState(i, prompt, SamplingParams(max_new_tokens=new), RequestMetrics(0.0))
        sched.add(seq)
        seqs.append(seq)
    _drive(sched, seqs, budget, max_seqs)
    assert cache.allocator.num_used == 0
    assert all(len(s.output) == s.params.max_new_tokens for s in seqs)


def test_preemption_puts_the_newest_back_first_and_it_resumes():
    cache = PagedCache.for_model(_MODEL, 6, 4)  # 24 tokens
    sched = Scheduler(cache, max_seqs=4, max_batch_tokens=64)
    a = SeqState(0, list(range(1, 9)), SamplingParams(max_new_tokens=8), RequestMetrics(0.0))
    b = SeqState(1, list(range(20, 28)), SamplingParams(max_new_tokens=8), RequestMetrics(0.0))
    sched.add(a)
    sched.add(b)
    steps = _drive(sched, [a, b], 64, 4)
    assert b.metrics.preemptions >= 1 and a.metrics.preemptions == 0  # the older one always progresses
    assert sched.preemptions >= 1 and steps > 8


def test_starvation_bound_stops_later_requests_passing_the_head():
    cache = PagedCache.for_model(_MODEL, 8, 4)  # 32 tokens
    sched = Scheduler(cache, max_seqs=8, max_batch_tokens=64, max_skips=2)
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
        plan, _ = sched.next_step()
        admitted_small += sum(1 for s, _ in plan if s in smalls and s.computed == 0)
        for seq in sched.complete(plan):
            seq.output.append(1)
            if len(seq.output) >= seq.params.max_new_tokens:
                sched.drop(seq)
    assert big.skips == 2
    assert admitted_small == 2  # two passed the head, then admission waited for it


@pytest.mark.parametrize("chunked", [True, False])
def test_a_request_larger_than_the_pool_is_named_not_deadlocked(chunked):
    cache = PagedCache.for_model(_MODEL, 2, 4)
    sched = Scheduler(cache, max_seqs=2, max_batch_tokens=4, chunked_prefill=chunked)
    big = SeqState(0, list(range(1, 20)), SamplingParams(max_new_tokens=2), RequestMetrics(0.0))
    sched.add(big)
    with pytest.raises(SequenceTooLarge) as e:
        while True:
            nxt = sched.next_step()
            assert nxt is not None
            for seq in sched.complete(nxt[0]):
                seq.output.append(1)
    assert e.value.seq is big
