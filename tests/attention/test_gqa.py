import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import infopt
from infopt.attention import Attention
from infopt.attention.gqa import GQA_SDPA_IMPL
from infopt.kvcache import Static
from infopt.models import tiny_model
from infopt.ops import cpp


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


# -- the static-cache path on the C++ paged kernel (unpadded compiled decode steps) ------------------------------------

def _kernel_ready():

    return cpp.load("paged_attention")


needs_kernel = pytest.mark.skipif(not _kernel_ready(), reason="the C++ paged-attention kernel cannot be built here")


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), h_kv=st.sampled_from([1, 2, 3]), groups=st.sampled_from([1, 3, 4]),
       q=st.integers(1, 6), blocks=st.integers(1, 8), d=st.sampled_from([16, 64]), bf16=st.booleans(),
       data=st.data())
def test_static_cache_attention_matches_causal_sdpa_over_the_filled_keys(b, h_kv, groups, q, blocks, d, bf16, data):
    """Each of the q new tokens reads the keys up to itself, and with a sliding window (Gemma 3's sliding layers)
    only its window: itself and the window - 1 keys before it, as transformers' sliding mask has it."""
    from infopt.attention.gqa import static_cache_attention

    length = 16 * blocks
    kv_len = data.draw(st.integers(q, length))
    window = data.draw(st.sampled_from([0, 1, 5, 16, 40]))
    dtype = torch.bfloat16 if bf16 else torch.float32
    g = torch.Generator().manual_seed(kv_len * 131 + q)
    query = torch.randn(b, h_kv * groups, q, d, generator=g).to(dtype)
    key = torch.randn(b, h_kv, length, d, generator=g).to(dtype)
    value = torch.randn(b, h_kv, length, d, generator=g).to(dtype)
    key[:, :, kv_len:] = float("nan")  # slots past the filled keys are never read
    value[:, :, kv_len:] = float("nan")
    got = static_cache_attention(query, key, value, torch.tensor([kv_len]), 0.3, window=window)
    # the q new tokens are the last of the kv_len keys: causal among themselves
    mask = torch.ones(q, kv_len, dtype=torch.bool).tril(kv_len - q)
    if window:  # query i sits at kv_len - q + i and reads keys j with (kv_len - q + i) - j < window
        mask &= ~torch.ones(q, kv_len, dtype=torch.bool).tril(kv_len - q - window)
    want = torch.nn.functional.scaled_dot_product_attention(
        query.float(), key[:, :, :kv_len].float(), value[:, :, :kv_len].float(), attn_mask=mask, scale=0.3,
        enable_gqa=True).transpose(1, 2)
    assert got.shape == (b, q, h_kv * groups, d) and got.dtype == dtype
    tol = 2e-2 if bf16 else 1e-5
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("arch, kv_dtype", [("llama", None), ("qwen2", None), ("llama", "float16"),
                                            ("qwen2", "bfloat16")])
def test_compiled_decode_on_the_kernel_keeps_greedy_tokens(arch, kv_dtype):
    """cpu-fast's shape of step (static cache, compiled, unpadded): the attention runs the kernel (counted by the
    profiler) and the tokens equal the eager static-cache ones. (k-token verifies take the same path:
    tests/compile/test_compile.py's speculative test stays token-identical through it.) A 16-bit cache
    (``Static(dtype=...)``) is read by the kernel as it is stored, and by the eager run as fp32 copies of the
    same values: the same tokens."""
    from torch.profiler import profile

    from infopt.compile import Compile

    ref, m = tiny_model(arch), tiny_model(arch)
    infopt.optimize(ref, [Static(max_length=64, dtype=kv_dtype)])
    infopt.optimize(m, [Static(max_length=64, dtype=kv_dtype), Compile(warmup_lengths=(64,))])
    p = torch.randint(3, 1000, (1, 7))
    with profile() as prof:
        got = m.generate(p, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, ref.generate(p, max_new_tokens=12, do_sample=False))
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get("infopt::paged_attention", 0) == 11 * m.config.num_hidden_layers


@needs_kernel
@pytest.mark.slow
def test_a_sliding_window_layer_decodes_on_the_kernel_within_its_window():
    """Gemma 3's sliding layers on the kernel too (before, they attended over the whole static cache through a
    mask): a window of 8 that the 7-token prompt and 16 new tokens slide through, the tokens of the eager
    static-cache run, every layer's step on the kernel."""
    from torch.profiler import profile
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from infopt.compile import Compile

    config = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, sliding_window=8, vocab_size=1000,
                              max_position_embeddings=512, initializer_range=0.1)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(AutoModelForCausalLM.from_config(config).eval())
    ref, m = models
    infopt.optimize(ref, [Static(max_length=64)])
    infopt.optimize(m, [Static(max_length=64), Compile(warmup_lengths=(64,))])
    p = torch.randint(3, 1000, (1, 7), generator=torch.Generator().manual_seed(0))
    with profile() as prof:
        got = m.generate(p, max_new_tokens=16, do_sample=False)
    assert torch.equal(got, ref.generate(p, max_new_tokens=16, do_sample=False))
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get("infopt::paged_attention", 0) == 15 * config.num_hidden_layers
