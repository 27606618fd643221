import pytest
import torch

from infopt.core.errors import RecipeError
from infopt.generate import routing_stats
from infopt.kvcache import Static, use_
from infopt.models import tiny_model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma", "gpt2", "mistral", "phi3"])
def test_greedy_token_identical(arch):
    m = tiny_model(arch)
    prompts = torch.tensor([[1, 5, 9, 300, 7, 2000], [4, 4, 8, 15, 16, 23]])
    ref = m.generate(prompts, max_new_tokens=20, do_sample=False)
    use_(m, Static(max_length=64))
    out = m.generate(prompts, max_new_tokens=20, do_sample=False)
    assert torch.equal(out, ref)
    out2 = m.generate(prompts[:1], max_new_tokens=20, do_sample=False)  # batch change: new allocation
    assert torch.equal(out2, ref[:1])
    assert routing_stats(m).infopt == 2


def test_cache_reused_across_calls(llama, prompt):
    use_(llama, Static(max_length=64))
    a = llama.generate(prompt, max_new_tokens=10, do_sample=False)
    b = llama.generate(prompt, max_new_tokens=10, do_sample=False)
    assert torch.equal(a, b)  # the reset cache holds nothing of the first call


def test_unsupported_calls_fall_back(llama, prompt):
    ref_beam = llama.generate(prompt, max_new_tokens=5, num_beams=2, do_sample=False)
    ref_long = llama.generate(prompt, max_new_tokens=40, do_sample=False)
    use_(llama, Static(max_length=32))
    assert torch.equal(llama.generate(prompt, max_new_tokens=5, num_beams=2, do_sample=False), ref_beam)
    assert torch.equal(llama.generate(prompt, max_new_tokens=40, do_sample=False), ref_long)
    stats = routing_stats(llama)
    assert stats.original == 2 and stats.infopt == 0
    assert any("max_length 32" in r for r in stats.reasons)


@pytest.mark.parametrize("bad", [0, -5, "long", True])
def test_bad_max_length(bad):
    with pytest.raises(RecipeError, match="max_length"):
        Static(max_length=bad)


def test_cache_sized_per_call_in_buckets(llama, prompt):
    from infopt.kvcache.static import bucket_length

    assert bucket_length(1, 512) == 256 and bucket_length(257, 512) == 512 and bucket_length(600, 512) == 512
    use_(llama, Static(max_length=512))
    holder_calls = []
    from transformers import StaticCache

    orig_init = StaticCache.__init__

    def spy(self, *a, **kw):
        holder_calls.append(kw.get("max_cache_len"))
        orig_init(self, *a, **kw)

    StaticCache.__init__ = spy
    try:
        llama.generate(prompt, max_new_tokens=10, do_sample=False)
        llama.generate(prompt, max_new_tokens=20, do_sample=False)  # same bucket: reused
        llama.generate(prompt, max_new_tokens=300, do_sample=False)  # next bucket
    finally:
        StaticCache.__init__ = orig_init
    assert holder_calls == [256, 512]


def test_first_call_under_inference_mode_then_outside():
    """The reused cache is allocated outside the caller's inference_mode, so a later plain call can reset it."""
    import infopt

    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=64)])
    p = torch.tensor([[1, 17, 400, 23, 9]])
    with torch.inference_mode():
        a = m.generate(p, max_new_tokens=6, do_sample=False)
    b = m.generate(p, max_new_tokens=6, do_sample=False)
    with torch.inference_mode():
        torch.manual_seed(0)
        c = m.generate(p, max_new_tokens=6, do_sample=True, bad_words_ids=[[7]])  # transformers' loop
    want = ref.generate(p, max_new_tokens=6, do_sample=False)
    torch.manual_seed(0)
    want_c = ref.generate(p, max_new_tokens=6, do_sample=True, bad_words_ids=[[7]])  # the same seed's draws
    assert torch.equal(a, want) and torch.equal(b, want) and torch.equal(c, want_c)


def test_transformers_loop_under_inference_mode_leaves_a_reusable_cache():
    """The fallback loop fills the cache lazily too; its tensors must stay resettable by a later plain call."""
    import infopt

    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=64)])
    p = torch.tensor([[1, 17, 400, 23, 9]])
    with torch.inference_mode():
        torch.manual_seed(0)
        m.generate(p, max_new_tokens=6, do_sample=True, bad_words_ids=[[7]])  # transformers' loop allocates
    assert torch.equal(m.generate(p, max_new_tokens=6, do_sample=False),
                       ref.generate(p, max_new_tokens=6, do_sample=False))


def test_calls_with_and_without_autocast_share_a_model():
    """A call under torch.autocast writes other dtypes than a plain one: it gets a static cache of its own (as a fresh
    transformers cache would), instead of failing in index_copy_ into the plain call's fp32 tensors, and the reverse."""
    import infopt

    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=64)])
    p = torch.tensor([[1, 17, 400, 23, 9]])
    plain = m.generate(p, max_new_tokens=6, do_sample=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = m.generate(p, max_new_tokens=6, do_sample=False)
        want_mixed = ref.generate(p, max_new_tokens=6, do_sample=False, cache_implementation="static")
    again = m.generate(p, max_new_tokens=6, do_sample=False)
    assert torch.equal(mixed, want_mixed)
    assert torch.equal(plain, ref.generate(p, max_new_tokens=6, do_sample=False)) and torch.equal(again, plain)


def test_num_return_sequences_gets_a_cache_for_every_returned_row():
    """generate expands each prompt num_return_sequences times: the static cache is sized for the expanded rows
    (before: sized for the prompts, so transformers' loop failed in index_copy_ on the first write)."""
    import infopt

    ref, m = tiny_model(), tiny_model()
    infopt.optimize(m, [Static(max_length=64)])
    p = torch.tensor([[1, 17, 400, 23, 9], [4, 4, 8, 15, 16]])
    kw = dict(max_new_tokens=6, do_sample=True, top_k=5, num_return_sequences=3)
    torch.manual_seed(0)
    out = m.generate(p, **kw)
    torch.manual_seed(0)
    want = ref.generate(p, **kw, cache_implementation="static")
    assert out.shape == (6, 11) and torch.equal(out, want)
    # the next plain call (2 rows) gets its own allocation again and the same tokens as without infopt
    assert torch.equal(m.generate(p, max_new_tokens=6, do_sample=False),
                       ref.generate(p, max_new_tokens=6, do_sample=False))


def test_16bit_cache_follows_the_attention_a_call_runs():
    """A held 16-bit cache is read as it is stored by infopt's GQA backend only: a call after the model's attention
    changed (here: back to sdpa) gets fp32 copies, and gives the tokens of a fresh model with the plain sdpa run."""
    from infopt.attention.backends import set_backend_
    from infopt.generate import decoder_for

    m, ref = tiny_model("llama"), tiny_model("llama")
    use_(ref, Static(max_length=64, dtype="float16"))
    use_(m, Static(max_length=64, dtype="float16"))
    p = torch.tensor([[1, 5, 9, 300, 7]])
    set_backend_(m, "sdpa_gqa")
    a = m.generate(p, max_new_tokens=8, do_sample=False)
    cache = decoder_for(m).cache.allocation().cache
    assert all(not layer.upcast and layer.keys.dtype == torch.float16 for layer in cache.layers)
    set_backend_(m, "sdpa")
    b = m.generate(p, max_new_tokens=8, do_sample=False)
    assert decoder_for(m).cache.allocation().cache is cache and all(layer.upcast for layer in cache.layers)
    assert torch.equal(b, ref.generate(p, max_new_tokens=8, do_sample=False)) and torch.equal(a, b)
