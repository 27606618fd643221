import pytest
import torch
from transformers import DynamicCache, StaticCache

from infopt.core.decode import greedy_decode, plan_greedy
from infopt.core.generation import Unsupported
from infopt.models import tiny_model


def _batch():
    # two left-padded rows and one full row
    ids = torch.tensor([[0, 0, 5, 17, 400, 23], [0, 9, 8, 7, 6, 5], [11, 12, 13, 14, 15, 16]])
    mask = (torch.arange(6)[None] >= torch.tensor([[2], [1], [0]])).long()
    return ids, mask


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma", "gpt2"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_matches_generate(arch, cache):
    m = tiny_model(arch)
    ids, mask = _batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    ref = m.generate(ids, **kwargs)
    # an EOS the model actually produces mid-way, so rows finish at different steps
    eos = int(ref[0, 6 + 3])
    ref = m.generate(ids, eos_token_id=eos, **kwargs)
    call = plan_greedy(m, (ids,), dict(eos_token_id=eos, **kwargs))
    c = DynamicCache() if cache == "dynamic" else StaticCache(config=m.config, max_cache_len=32)
    out = greedy_decode(m, call, c)
    assert torch.equal(out, ref)


def test_min_new_tokens_and_max_length():
    m = tiny_model()
    ids = torch.tensor([[1, 17, 400, 23, 9]])
    eos = int(m.generate(ids, max_new_tokens=3, do_sample=False)[0, 5])
    for kw in (dict(min_new_tokens=6, max_new_tokens=10), dict(max_length=12)):
        kw = dict(kw, eos_token_id=eos, do_sample=False)
        ref = m.generate(ids, **kw)
        assert torch.equal(greedy_decode(m, plan_greedy(m, (ids,), kw), DynamicCache()), ref)


@pytest.mark.parametrize("kwargs", [
    {"do_sample": True}, {"num_beams": 2}, {"repetition_penalty": 1.2}, {"assistant_model": object()},
    {"output_scores": True, "return_dict_in_generate": True}, {"logits_processor": []}, {"max_new_tokens": 0},
])
def test_unsupported_calls_are_named(kwargs):
    m = tiny_model()
    with pytest.raises(Unsupported):
        plan_greedy(m, (torch.tensor([[1, 2, 3]]),), dict(kwargs))


def test_streamer_sees_what_generate_shows():
    class Rec:
        def __init__(self):
            self.seen, self.ended = [], False

        def put(self, v):
            self.seen.append(v.tolist())

        def end(self):
            self.ended = True

    m = tiny_model()
    ids = torch.tensor([[1, 17, 400, 23, 9]])
    a, b = Rec(), Rec()
    ref = m.generate(ids, max_new_tokens=5, do_sample=False, streamer=a)
    out = greedy_decode(m, plan_greedy(m, (ids,), dict(max_new_tokens=5, do_sample=False, streamer=b)), DynamicCache())
    assert torch.equal(out, ref) and a.seen == b.seen and b.ended
