"""The lean loop's sampling path draws the same tokens as generate for the same seed."""

import pytest
import torch

import infopt
from infopt.generate import parse_call, routing_stats
from infopt.kvcache import Static
from infopt.models import tiny_model


@pytest.mark.parametrize("kw", [
    dict(do_sample=True),  # top_k unset: generate's default 50 applies to both
    dict(do_sample=True, temperature=0.7, top_p=0.9),
    dict(do_sample=True, top_k=0, min_p=0.05, temperature=1.3),
    dict(do_sample=True, top_k=5, min_new_tokens=12),
])
def test_seeded_sampling_identical_to_generate(kw):
    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=128)])
    for p in (torch.tensor([[1, 17, 400, 23, 9, 1200, 5]]), torch.randint(3, 1000, (2, 6))):
        torch.manual_seed(1)
        a = ref.generate(p, max_new_tokens=16, pad_token_id=2, **kw)
        torch.manual_seed(1)
        b = m.generate(p, max_new_tokens=16, pad_token_id=2, **kw)
        assert torch.equal(a, b)
    assert routing_stats(m).original == 0


def test_sampling_the_loop_does_not_cover_runs_transformers_loop_on_the_static_cache():
    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=64)])
    p = torch.tensor([[1, 2, 3]])
    kw = dict(max_new_tokens=6, do_sample=True, bad_words_ids=[[7]])
    torch.manual_seed(0)
    a = ref.generate(p, **kw)
    torch.manual_seed(0)
    assert torch.equal(m.generate(p, **kw), a)
    assert routing_stats(m).loops == {"transformers+cache": 1}
    assert "bad_words_ids" in parse_call(m, (p,), kw).lean_reason
