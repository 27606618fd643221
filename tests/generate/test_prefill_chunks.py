"""Long prompts fill the cache a chunk at a time (infopt.generate.forward.PREFILL_CHUNK): the same logits and cache
as one forward over the whole prompt, up to summation order, and only where the cache keeps every key at its slot."""

import pytest
import torch
from transformers import DynamicCache

import infopt
from infopt.core.compat import CACHE_KWARG
from infopt.generate import forward as fw
from infopt.kvcache import Quantized
from infopt.kvcache.quantized_cache import QuantizedKVCache
from infopt.kvcache.static import full_length_static_cache
from infopt.models import tiny_model

T = 50


def _ids(m, n=T, seed=0):
    return torch.randint(0, m.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def _prefill(m, cache, chunk, monkeypatch, keep=1):
    monkeypatch.setattr(fw, "PREFILL_CHUNK", chunk)
    calls = []
    hook = m.register_forward_pre_hook(lambda mod, args, kw: calls.append(kw["input_ids"].shape[1]), with_kwargs=True)
    ids = _ids(m)
    with torch.inference_mode():
        logits = fw.Forward(m).prefill(ids, torch.arange(T)[None], None, cache, keep=keep)
    hook.remove()
    return logits, calls


def _keys(cache):
    return torch.cat([layer.keys[..., :T, :].flatten() for layer in cache.layers])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_long_prompt_fills_the_cache_in_chunks_with_the_logits_and_keys_of_one_forward(arch, kind, monkeypatch):
    m = tiny_model(arch, num_layers=2)

    def cache():
        return DynamicCache(config=m.config) if kind == "dynamic" else full_length_static_cache(m.config, 256)

    if kind == "dynamic" and arch == "gemma3":  # a sliding-window dynamic layer drops keys: never chunked
        assert not fw.chunks_prefill(cache())
        return
    whole, whole_calls = _prefill(m, (a := cache()), 10_000, monkeypatch)
    parts, part_calls = _prefill(m, (b := cache()), 16, monkeypatch)
    assert whole_calls == [T] and part_calls == [16, 16, 16, 2]
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_keys(b), _keys(a), rtol=1e-5, atol=1e-5)


def test_caches_that_see_a_prompt_whole_are_not_chunked(monkeypatch):
    m = tiny_model("llama", num_layers=2)
    filled = DynamicCache(config=m.config)
    with torch.inference_mode():
        m(_ids(m, 4), **{CACHE_KWARG: filled}, use_cache=True)
    assert not fw.chunks_prefill(filled)  # not empty: the prompt continues a cache (a chat's next turn)
    assert not fw.chunks_prefill(QuantizedKVCache(m.config, Quantized(bits=4)))
    # keep more positions than the last chunk has: one forward
    _, calls = _prefill(m, DynamicCache(config=m.config), 16, monkeypatch, keep=3)
    assert calls == [T]


def test_generate_with_a_static_cache_prefills_in_chunks_and_decodes_as_plain_generate(monkeypatch):
    m = tiny_model("llama", num_layers=2)
    ids = _ids(m, 40, seed=3)
    with torch.inference_mode():
        want = m.generate(ids, max_new_tokens=8, do_sample=False)
        ref = m(ids).logits[:, -1]
    infopt.optimize(m, [{"kvcache": {"kind": "static"}}])
    monkeypatch.setattr(fw, "PREFILL_CHUNK", 16)
    calls = []
    hook = m.register_forward_pre_hook(lambda mod, args, kw: calls.append(kw["input_ids"].shape[1]), with_kwargs=True)
    got = m.generate(ids, max_new_tokens=8, do_sample=False)
    hook.remove()
    assert calls[:3] == [16, 16, 8] and set(calls[3:]) == {1}
    # the first token's logits: the chunked prompt's against one plain forward, within float noise
    margin = (ref.topk(2).values[0, 0] - ref.topk(2).values[0, 1]).item()
    assert margin > 1e-4, "a near-tie at the first token would make the token comparison meaningless"
    assert torch.equal(got, want)
