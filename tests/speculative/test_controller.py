"""The adaptive draft length: backs off to plain decoding when drafts fail, lengthens while they are accepted."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from infopt.speculative import Controller


def feed(c, rounds, accept):
    ks = []
    for _ in range(rounds):
        k = c.next_k()
        ks.append(k)
        a = k if accept else 0
        c.update(k, torch.tensor([a]), torch.tensor([k]))
    return ks


def test_backs_off_to_plain_and_probes_rarely():
    c = Controller(None, 8, draft_cost=0.35, verify_cost=0.06, prior_acceptance=0.7, probe_every=16)
    ks = feed(c, 400, accept=False)
    assert ks[0] > 0 and ks[-50:].count(0) >= 45
    probes = sum(1 for k in ks[50:] if k > 0)
    assert probes <= 350 / 16  # probes thin out while they keep failing


def test_grows_while_accepted():
    c = Controller(None, 8, draft_cost=0.0, verify_cost=0.06, prior_acceptance=0.5)
    ks = feed(c, 30, accept=True)
    assert ks[-1] == 8 and ks[-1] > ks[0]


def test_fixed_length_is_fixed():
    c = Controller(3, 3, draft_cost=0.5, verify_cost=0.06)
    assert feed(c, 10, accept=False) == [3] * 10


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 8), st.booleans()), max_size=40), st.floats(0.0, 1.0))
def test_length_always_within_cap(history, cost):
    c = Controller(None, 8, draft_cost=cost, verify_cost=0.06)
    for a, full in history:
        k = c.next_k()
        assert 0 <= k <= 8
        c.update(k, torch.tensor([k if full else min(a, max(k - 1, 0))]), torch.tensor([k]))
