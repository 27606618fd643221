"""A generate call infopt does not serve is logged once per reason and model, at WARNING, with what to change."""

import logging

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

import infopt
from infopt.generate import routing_stats, uncounted
from infopt.kvcache import Static
from infopt.models import tiny_model

IDS = torch.tensor([[1, 17, 400, 23, 9]])


class _Sink(BaseStreamer):
    """A streamer that keeps what it is given."""

    def __init__(self):
        self.pieces = []

    def put(self, value):
        self.pieces.append(value)

    def end(self):
        pass


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "infopt" and r.levelno == logging.WARNING]


# the throughput preset's steps without compiling the engine (seconds per model on CPU): the same routing
ENGINE = [{"kvcache": {"kind": "paged"}}, {"batching": {"max_seqs": 64, "max_batch_tokens": 512}}]


@pytest.fixture
def engine_model():
    return infopt.optimize(tiny_model(), ENGINE)


@pytest.mark.slow
def test_throughput_fallbacks_are_logged_once_per_reason(caplog):
    m = infopt.optimize(tiny_model(), "throughput")
    with caplog.at_level(logging.WARNING, logger="infopt"):
        for n in (2, 3, 2):  # one reason, whatever the count
            m.generate(IDS, max_new_tokens=3, num_return_sequences=n, do_sample=True)
        sink = _Sink()
        for _ in range(2):
            m.generate(IDS, max_new_tokens=3, streamer=sink, do_sample=False)
        m.generate(IDS, max_new_tokens=3, do_sample=False)  # the engine serves it: nothing logged
    logged = _warnings(caplog)
    assert len(logged) == 2, logged
    nrs, stream = logged
    assert "handed to transformers' own generate" in nrs and "num_return_sequences=2" in nrs
    assert "repeat each prompt in the batch" in nrs  # what to change to be served
    assert "a streamer" in stream and "batching_engine(model).submit(prompt_ids).stream()" in stream
    assert sink.pieces  # the fall-back still streamed
    stats = routing_stats(m)
    assert (stats.original, stats.infopt) == (5, 1)  # every call is still counted
    assert stats.reasons["a streamer (the engine streams through Engine.stream)"] == 2


def test_each_model_logs_its_own_fallbacks(engine_model, caplog):
    other = infopt.optimize(tiny_model(), ENGINE)
    with caplog.at_level(logging.WARNING, logger="infopt"):
        for m in (engine_model, other, engine_model):
            m.generate(IDS, max_new_tokens=3, num_return_sequences=2, do_sample=True)
    assert len(_warnings(caplog)) == 2


def test_uncounted_calls_log_nothing(engine_model, caplog):
    with caplog.at_level(logging.WARNING, logger="infopt"), uncounted(engine_model):
        engine_model.generate(IDS, max_new_tokens=3, num_return_sequences=2, do_sample=True)
    assert _warnings(caplog) == []


def test_transformers_loop_on_the_cache_is_logged_once(caplog):
    m = infopt.optimize(tiny_model(), [Static(max_length=64)])
    with caplog.at_level(logging.WARNING, logger="infopt"):
        for _ in range(2):
            m.generate(IDS, max_new_tokens=3, bad_words_ids=[[7]], do_sample=False)
        m.generate(IDS, max_new_tokens=3, do_sample=False)
    logged = _warnings(caplog)
    assert len(logged) == 1, logged
    assert "transformers' decode loop on infopt's KV cache" in logged[0]
    assert "bad_words_ids" in logged[0] and "leave those arguments out of the call" in logged[0]
    assert routing_stats(m).loops == {"transformers+cache": 2, "lean": 1}
