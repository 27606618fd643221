"""The demo: plain and optimized decode timed in alternating rounds, both answers shown, chat answers compared."""

import pytest
import torch

from infopt import demo


class _Recorder:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def generate(self, ids, max_new_tokens, do_sample):
        self.log.append((self.name, max_new_tokens))
        return torch.cat([ids, torch.zeros(1, max_new_tokens, dtype=ids.dtype)], dim=1)


def test_rounds_alternate_which_side_runs_first():
    log = []
    models = {"plain": _Recorder("plain", log), "infopt": _Recorder("infopt", log)}
    rates, outs = demo.interleaved_rates(models, torch.ones(1, 3, dtype=torch.long), max_new_tokens=5, rounds=4)
    timed = [name for name, n in log if n == 5]
    assert log[:2] == [("plain", 8), ("infopt", 8)]  # one warm-up call each first
    assert timed == ["plain", "infopt", "infopt", "plain", "plain", "infopt", "infopt", "plain"]
    assert {k: len(v) for k, v in rates.items()} == {"plain": 4, "infopt": 4} and all(
        r > 0 for v in rates.values() for r in v)
    assert outs["plain"].shape == (1, 8)


@pytest.mark.real_model
@pytest.mark.slow
def test_the_demo_shows_both_answers_the_spread_and_the_chat_agreement(capsys):
    assert demo.main(["--recipe", "memory-saver", "--rounds", "2", "--max-new-tokens", "8", "--answers", "2"]) == 0
    out = capsys.readouterr().out
    for line in ("A (plain HF):", "A (infopt):", "decode tokens/s (median of 2)", "spread over the rounds",
                 "chat answers identical (of 2)", "rounds alternated"):
        assert line in out, line
