"""The adaptive draft length: backs off to plain decoding when drafts fail, lengthens while they are accepted."""

import pytest
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


def test_measured_verify_costs_pick_the_length_that_fills_a_bucket():
    # a compiled CPU verify: 2..8 tokens cost about the same (one graph per power-of-two bucket), 9..16 more
    flat = [1.0] + [1.6] * 7 + [2.1]
    c = Controller(None, 8, draft_cost=0.2, verify_costs=flat, prior_acceptance=0.95)
    assert c.round_cost == [1.0] + [0.2 * k + 1.6 for k in range(1, 8)] + [0.2 * 8 + 2.1]
    c.verified = 4
    assert c.best_k() == 7  # 8 tokens verified: drafting an eighth would pay for a 16-token verify
    # at 60% acceptance no draft length earns back such a verify; with the default (eager) costs, growing with k
    # from one decode step, two drafted tokens still pay
    low = Controller(None, 8, draft_cost=0.2, verify_costs=flat, prior_acceptance=0.6)
    eager = Controller(None, 8, draft_cost=0.2, verify_cost=0.06, prior_acceptance=0.6)
    low.verified = eager.verified = 4
    assert (low.best_k(), eager.best_k()) == (0, 2)
    with pytest.raises(ValueError, match="verify_costs has 3 entries; 9 needed"):
        Controller(None, 8, draft_cost=0.2, verify_costs=[1.0, 1.5, 1.5])


def test_one_rejected_first_round_does_not_stop_drafting():
    # where a verify costs well above a decode step, one rejection moves a fresh estimate below break-even:
    # the controller keeps drafting until a few rounds were verified
    c = Controller(None, 8, draft_cost=0.2, verify_costs=[1.0] + [1.6] * 8, prior_acceptance=0.7)
    ks = [c.next_k()]
    c.update(ks[0], torch.tensor([0]), torch.tensor([ks[0]]))
    for _ in range(Controller.MIN_EVIDENCE - 1):
        ks.append(c.next_k())
        c.update(ks[-1], torch.tensor([ks[-1]]), torch.tensor([ks[-1]]))
    assert all(k >= 1 for k in ks)
    assert c.next_k() >= 3  # accepted rounds brought the estimate back
