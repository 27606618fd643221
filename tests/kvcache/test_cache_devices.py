"""KV caches on each device (``cpu``, and ``cuda`` under the gpu marker): the lossless kinds (static, paged)
token-identical to plain ``generate`` on the same model, the quantized one within its KL / top-1 bounds, each with its
cache allocated on the model's device.

Models are fp32: bf16 logits of a random tiny model tie often enough that two correct attention paths (a
static cache's full-length masked attention, the paged gather) could pick different argmaxes."""

import pytest
import torch

import infopt
from infopt.eval import assert_same_tokens, greedy_outputs
from infopt.generate import routing_stats
from infopt.kvcache import Paged, Quantized, Static, paged_pool, use_, use_paged_
from infopt.models import tiny_model

from .test_paged import padded

PROMPTS = [[1, 17, 400, 23, 9, 1200, 5], [4, 4, 8, 15, 16, 23, 42, 7], [77, 78]]


def head64(device, **kw):
    """head_dim 64 (the default model's), so KV group sizes of 16-64 fit."""
    return tiny_model("llama", hidden_size=128, num_heads=2, num_kv_heads=1, **kw).to(device)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_static_token_identical(arch, device):
    from transformers import StaticCache

    from infopt.generate import decoder_for

    m = tiny_model(arch).to(device)
    ref = greedy_outputs(m, PROMPTS, 24)
    ids, mask = (t.to(device) for t in padded(PROMPTS))
    ref_batch = m.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    infopt.optimize(m, [Static(max_length=256)])
    assert_same_tokens(ref, greedy_outputs(m, PROMPTS, 24))
    part = decoder_for(m).cache
    held = part.allocation(m)  # one prompt at a time: batch 1, the first 256-token bucket, on the model's device
    assert isinstance(held.cache, StaticCache) and (held.batch, held.length) == (1, 256)
    assert (held.device.type, held.dtype, held.autocast) == (device, torch.float32, (device, False, None))
    assert all(layer.keys.device.type == device and layer.keys.shape[2] == 256 for layer in held.cache.layers)
    out = m.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref_batch)  # left padding through the lean loop's mask
    again = part.allocation(m)  # the batch of three: a new allocation, same bucket
    assert (again.batch, again.length, again.device.type) == (3, 256, device) and again.cache is not held.cache
    assert routing_stats(m).infopt == len(PROMPTS) + 1 and routing_stats(m).original == 0


@pytest.fixture
def quantized_caches(monkeypatch):
    """Every cache a Quantized config builds for a generate call."""
    made = []
    real = Quantized.new_cache

    def spy(self, model):
        made.append(real(self, model))
        return made[-1]

    monkeypatch.setattr(Quantized, "new_cache", spy)
    return made


@pytest.mark.parametrize("bits", [8, 4], ids=["int8", "int4"])
def test_quantized_identical_within_the_residual_window(bits, quantized_caches, device):
    from infopt.kvcache.quantized_cache import QuantizedKVCache

    m = head64(device)
    new = 32 - max(map(len, PROMPTS))  # prompt + new <= residual_length: every token stays exact
    ref = greedy_outputs(m, PROMPTS, new)
    use_(m, Quantized(bits=bits, group_size=16, residual_length=32))
    assert_same_tokens(ref, greedy_outputs(m, PROMPTS, new))
    assert len(quantized_caches) == len(PROMPTS) and routing_stats(m).infopt == len(PROMPTS)
    for cache in quantized_caches:
        assert isinstance(cache, QuantizedKVCache) and cache.quantized.bits == bits
        assert cache.layers[0].keys.device.type == device and cache.layers[0].n_quant == 0


@pytest.mark.parametrize("bits, kl_bound", [(8, 1e-4), (4, 1e-3)], ids=["int8", "int4"])
def test_quantized_logits_close_past_the_residual_window(bits, kl_bound, quantized_caches, device):
    m = head64(device)
    ids = torch.randint(3, 40_000, (1, 320), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        ref = m(ids).logits[0, 256:].float()
        cache = Quantized(bits=bits, group_size=32, residual_length=64).new_cache(m)
        m(ids[:, :256], past_key_values=cache)
        assert cache.layers[0].n_quant == 256 and cache.layers[0].n_res == 0
        out = m(ids[:, 256:], past_key_values=cache).logits[0].float()
    lp_ref, lp = ref.log_softmax(-1), out.log_softmax(-1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)  # [64] nats per position
    assert float(kl.mean()) < kl_bound
    assert float((ref.argmax(-1) == out.argmax(-1)).float().mean()) >= 0.95
    b = cache.memory_bytes()
    assert b.tokens == 320 and b.used < 0.5 * b.dense_fp32  # stored as codes, not as fp32
    # and generate past the window runs on a quantized cache on the model's device
    use_(m, Quantized(bits=bits, group_size=16, residual_length=32))
    out = m.generate(ids[:, :40], max_new_tokens=40, do_sample=False)
    assert out.shape == (1, 80) and out.device.type == device
    layer = quantized_caches[-1].layers[0]
    assert layer.n_quant == 64 and layer.keys.device.type == device  # 79 tokens cached: two 32-token chunks quantized


def test_paged_token_identical(device):
    m = tiny_model("llama").to(device)
    ids, mask = (t.to(device) for t in padded(PROMPTS))
    ref = m.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
    use_paged_(m, Paged(block_size=16))
    out = m.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)
    pool = paged_pool(m)
    assert all(k.device.type == device for k in pool.keys) and all(v.device.type == device for v in pool.values)
    assert pool.allocator.num_used == 0  # every block released when the call ended
    for row in range(len(PROMPTS)):  # each prompt alone: the prefix cache serves its full blocks
        alone = ids[row:row + 1, int(mask[row].argmax()):]
        assert torch.equal(m.generate(alone, max_new_tokens=32, do_sample=False),
                           ref[row:row + 1, int(mask[row].argmax()):])
    assert routing_stats(m).infopt == 1 + len(PROMPTS) and routing_stats(m).original == 0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_static_16bit_cache_stores_rounded_keys_and_stays_close(dtype, device):
    """``Static(dtype=...)`` keeps keys and values in 16 bits on the model's device: layer 0's are the fp32 cache's
    rounded once (the bits, not just close), the logits stay within a small KL of the fp32 cache's, and generate
    runs on it; the step says it is lossy."""
    from infopt.generate import decoder_for
    from infopt.kvcache.static import CACHE_DTYPES

    want = CACHE_DTYPES[dtype]
    ids = torch.randint(3, 40_000, (1, 200), generator=torch.Generator().manual_seed(0)).to(device)
    logits, caches = {}, {}
    for kind in (None, dtype):
        m = head64(device)
        infopt.optimize(m, [Static(max_length=256, dtype=kind)])
        out = m.generate(ids, max_new_tokens=1, do_sample=False, output_logits=True, return_dict_in_generate=True)
        logits[kind] = out.logits[0][0].float()
        caches[kind] = decoder_for(m).cache.allocation().cache
    assert Static(dtype=dtype).fidelity == "lossy" and Static().fidelity == "lossless"
    k16, k32 = caches[dtype].layers[0].keys, caches[None].layers[0].keys
    assert k16.dtype == want and k32.dtype == torch.float32 and k16.device.type == device
    assert torch.equal(k16[:, :, :200], k32[:, :, :200].to(want))
    lp_ref, lp = logits[None].log_softmax(-1), logits[dtype].log_softmax(-1)
    assert float((lp_ref.exp() * (lp_ref - lp)).sum()) < 1e-3


def test_static_16bit_cache_refuses_other_dtypes():
    from infopt.core.errors import RecipeError

    with pytest.raises(RecipeError, match="dtype.*float16, bfloat16"):
        Static(dtype="int8")
    with pytest.raises(RecipeError, match="dtype"):
        infopt.Recipe.parse({"steps": [{"kvcache": {"kind": "static", "dtype": "float64"}}]})
