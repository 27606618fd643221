import pytest
import torch

import infopt
from infopt.attention import Attention
from infopt.attention.gqa import GQA_SDPA_IMPL
from infopt.kvcache import Static
from infopt.models import tiny_model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_same_logits_and_tokens_as_sdpa(arch):
    ref, m = tiny_model(arch), tiny_model(arch)  # 4 query heads over 2 KV heads
    infopt.optimize(m, [Attention("sdpa_gqa")])
    assert m.config._attn_implementation == GQA_SDPA_IMPL
    ids = torch.randint(3, 1000, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    torch.testing.assert_close(m(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits,
                               rtol=1e-5, atol=1e-5)
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(m.generate(ids, **kw), ref.generate(ids, **kw))
    infopt.undo(m)
    assert m.config._attn_implementation == "sdpa"


def test_static_cache_prefill_and_decode_identical():
    """The static cache passes a mask at every step, the case this backend exists for."""
    ref, m = tiny_model(), tiny_model()
    infopt.optimize(ref, [Static(max_length=64)])
    infopt.optimize(m, [Attention("sdpa_gqa"), Static(max_length=64)])
    for n in (1, 6, 20):
        p = torch.randint(3, 1000, (1, n))
        assert torch.equal(m.generate(p, max_new_tokens=12, do_sample=False),
                           ref.generate(p, max_new_tokens=12, do_sample=False))


def test_compile_switches_sdpa_to_gqa_on_cpu():
    from infopt.compile import Compile

    m = tiny_model()
    infopt.optimize(m, [Static(max_length=64), Compile(backend="eager")])
    assert m.config._attn_implementation == GQA_SDPA_IMPL
    assert any("sdpa_gqa" in n for n in m.infopt.steps[-1].notes)
    infopt.undo(m)
    assert m.config._attn_implementation == "sdpa"


def test_compile_leaves_eager_attention_alone():
    from infopt.compile import Compile

    m = tiny_model(attn_implementation="eager")
    infopt.optimize(m, [Static(max_length=64), Compile(backend="eager")])
    assert m.config._attn_implementation == "eager"
