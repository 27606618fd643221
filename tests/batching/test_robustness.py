"""1,000 requests from 8 threads with random lengths, cancellations, stop strings and bad input: every request
finishes or is cancelled, no KV block leaks, no deadlock (bounded by join timeouts, not by timing asserts)."""

from __future__ import annotations

import random
import threading

import pytest

from infopt.batching import Engine, SamplingParams
from infopt.kvcache import Paged
from infopt.models import tiny_model


@pytest.mark.slow
def test_thousand_requests_from_eight_threads(default_tokenizer):
    model = tiny_model(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1)
    engine = Engine(model, default_tokenizer, max_batch_tokens=96, max_seqs=24,
                    kv=Paged(block_size=8, num_blocks=48))  # 384 tokens: preemption happens
    words = ["the", "a", "model", "cache", "token", "batch", "and", "of", "to", "in"]
    outcomes: dict[str, int] = {"length": 0, "stop": 0, "cancelled": 0, "rejected": 0}
    lock = threading.Lock()
    errors: list[str] = []

    def client(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(125):
                kind = rng.random()
                if kind < 0.03:  # bad input: refused at once with a clear error
                    try:
                        engine.submit([], SamplingParams(max_new_tokens=4))
                    except ValueError as e:
                        assert "empty prompt" in str(e)
                        with lock:
                            outcomes["rejected"] += 1
                    continue
                prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))
                stop = (rng.choice(words),) if rng.random() < 0.3 else ()
                params = SamplingParams(max_new_tokens=rng.randint(1, 24), stop=stop,
                                        temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(1000))
                h = engine.submit(prompt, params)
                if rng.random() < 0.2:
                    h.cancel()
                out = h.result(timeout=300)
                assert out.finish_reason in ("length", "stop", "cancelled"), out.error
                assert len(out.token_ids) <= params.max_new_tokens
                if out.finish_reason == "length":
                    assert len(out.token_ids) == params.max_new_tokens
                if stop and out.finish_reason == "stop" and out.text is not None:
                    assert stop[0] not in out.text
                with lock:
                    outcomes[out.finish_reason] += 1
        except BaseException as e:  # surfaced below: a thread's failure must fail the test
            errors.append(f"{type(e).__name__}: {e}")

    with engine:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert not any(t.is_alive() for t in threads), "a client thread is stuck (deadlock)"
    assert not errors, errors[:3]
    assert sum(outcomes.values()) == 1000
    assert outcomes["cancelled"] > 0 and outcomes["rejected"] > 0 and outcomes["stop"] > 0
    m = engine.metrics()
    assert m["finished"] + m["cancelled"] == 1000 - outcomes["rejected"] and m["errors"] == 0
    assert engine.cache.allocator.num_used == 0  # no block leaks
    engine.cache.allocator.check_invariants()
    assert not engine.scheduler.has_work() and not engine._handles
