import pytest
import torch
import torch.nn.functional as F

import infopt
from infopt.attention import PAGED_IMPL, Attention, PagedAttentionMetadata, set_backend_
from infopt.attention.paged import bind, kernel_calls, paged_attention_forward, set_cpu_kernel
from infopt.core.errors import RecipeError
from infopt.kvcache import Paged, PagedCache
from infopt.models import tiny_model
from infopt.ops import cpp


def test_paged_is_a_valid_backend():
    assert Attention("paged").to_dict() == {"attention": {"backend": "paged", "prompt_dtype": None}}
    with pytest.raises(RecipeError, match="allowed: eager, sdpa, sdpa_gqa, flash_attention_2, flex, paged"):
        Attention("pagd")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma", "gpt2"])
def test_backend_without_paged_cache_is_sdpa(arch):
    """Calls no paged cache serves (a plain forward, a DynamicCache generate, left padding) run SDPA."""
    m = tiny_model(arch)
    ids = torch.tensor([[0, 0, 5, 9, 300, 7], [4, 4, 8, 15, 16, 23]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        ref_logits = m(ids, attention_mask=mask).logits
    ref = m.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    set_backend_(m, "paged")
    assert m.config._attn_implementation == PAGED_IMPL
    with torch.no_grad():
        torch.testing.assert_close(m(ids, attention_mask=mask).logits, ref_logits, atol=1e-6, rtol=0)
    assert torch.equal(m.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0), ref)
    infopt.undo(m)
    assert m.config._attn_implementation == "sdpa"


def test_attention_step_then_kvcache_through_optimize():
    m = tiny_model("llama")
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]])
    ref = m.generate(prompt, max_new_tokens=10, do_sample=False)
    infopt.optimize(m, [Attention("paged"), Paged(block_size=4)])
    assert torch.equal(m.generate(prompt, max_new_tokens=10, do_sample=False), ref)
    assert infopt.undo(m) > 0 and m.config._attn_implementation == "sdpa"


def _naive(q, keys, values, scale):
    """Per-sequence causal attention over dense K/V: q [H, n, D] at the last n positions of keys [L, H_kv, D]."""
    h, n, d = q.shape
    rep = h // keys.shape[1]
    k = keys.transpose(0, 1).repeat_interleave(rep, 0)  # [H, L, D]
    v = values.transpose(0, 1).repeat_interleave(rep, 0)
    length = k.shape[1]
    allowed = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)  # [H, n, D]


def test_reference_kernel_matches_dense_attention():
    """Scattered blocks, GQA, three sequences with different history and new-token counts, packed in one row."""
    torch.manual_seed(0)
    bs, heads, kv_heads, d, num_blocks = 4, 4, 2, 8, 20
    k_pool, v_pool = torch.randn(num_blocks, bs, kv_heads, d), torch.randn(num_blocks, bs, kv_heads, d)
    tables = [[7, 2, 15], [4], [11, 0, 19, 3]]
    kv_lens = torch.tensor([10, 3, 16])
    new = torch.tensor([4, 1, 6])
    s, q = 3, int(new.max())
    table = torch.tensor([t + [0] * (4 - len(t)) for t in tables])
    seq_of = torch.repeat_interleave(torch.arange(s), new)
    off = new.cumsum(0) - new
    idx = torch.arange(int(new.sum())) - off[seq_of]
    grid = torch.arange(q)[None, :]
    inside = grid < new[:, None]
    query_pos = torch.where(inside, (kv_lens - new)[:, None] + grid, 0)
    meta = PagedAttentionMetadata(
        block_size=bs, block_table=table, kv_lens=kv_lens, query_pos=query_pos,
        mask=(torch.arange(4 * bs)[None, None, :] <= query_pos[:, :, None])[:, None],
        gather=off[:, None] + torch.minimum(grid, new[:, None] - 1), scatter=seq_of * q + idx, token_index=None,
        new_lens=new,
    )
    query = torch.randn(1, heads, int(new.sum()), d)
    module = torch.nn.Module()
    bind(k_pool, v_pool, meta)
    out, weights = paged_attention_forward(module, query, k_pool, v_pool, None, scaling=0.3)
    assert weights is None and out.shape == (1, int(new.sum()), heads, d)
    for i, t in enumerate(tables):
        slots = torch.tensor([b * bs + j for b in t for j in range(bs)])[: kv_lens[i]]
        keys = k_pool.reshape(-1, kv_heads, d)[slots]
        values = v_pool.reshape(-1, kv_heads, d)[slots]
        mine = out[0, off[i]:off[i] + new[i]].transpose(0, 1)  # [H, n, D]
        want = _naive(query[0, :, off[i]:off[i] + new[i]], keys, values, 0.3)
        torch.testing.assert_close(mine, want, atol=1e-5, rtol=0)


def test_binding_is_consumed_once():
    """A stale binding never leaks into a later, unrelated attention call."""
    m = set_backend_(tiny_model("llama"), "paged")
    cache = PagedCache.for_model(m, num_blocks=8, block_size=4)
    cache.add_sequence(0)
    with torch.no_grad():
        cache.step(m, [(0, [1, 2, 3])])
        plain = m(torch.tensor([[1, 2, 3]])).logits  # no paged cache: the SDPA path
    infopt.undo(m)
    with torch.no_grad():
        torch.testing.assert_close(m(torch.tensor([[1, 2, 3]])).logits, plain, atol=1e-6, rtol=0)


def _ran(before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] for k, v in kernel_calls().items()}


def test_kernel_calls_name_the_kernel_each_layer_ran():
    m = tiny_model("llama")
    infopt.optimize(m, [Paged(block_size=256)])
    prompt = torch.tensor([[1, 17, 400, 23, 9, 1200, 5]])
    cpu = cpp.load("paged_attention")
    before = kernel_calls()
    out = m.generate(prompt, max_new_tokens=16, do_sample=False)
    # 16 forwards x 2 layers, on CPU: the C++ kernel where it could be built, else the torch reference
    assert _ran(before) == {"cpu": 32 if cpu else 0, "flash_attn": 0, "triton": 0, "triton_prefill": 0, "reference": 0 if cpu else 32,
                              "sdpa": 0}
    previous = set_cpu_kernel(False)
    try:
        before = kernel_calls()
        assert torch.equal(m.generate(prompt, max_new_tokens=16, do_sample=False), out)
        assert _ran(before) == {"cpu": 0, "flash_attn": 0, "triton": 0, "triton_prefill": 0, "reference": 32, "sdpa": 0}
    finally:
        set_cpu_kernel(previous)
    before = kernel_calls()
    with torch.no_grad():
        m(torch.tensor([[1, 2, 3]]))  # no paged cache: SDPA
    assert _ran(before) == {"cpu": 0, "flash_attn": 0, "triton": 0, "triton_prefill": 0, "reference": 0, "sdpa": 2}


@pytest.mark.parametrize("block_size", [256, 16], ids=["bs256", "bs16"])
def test_paged_generate_bf16(block_size, device):
    from tests.attention.helpers import assert_greedy_close
    from tests.devices import DEVICES

    ref = tiny_model("llama", dtype=torch.bfloat16).to(device)
    m = tiny_model("llama", dtype=torch.bfloat16).to(device)
    prompt = torch.tensor([[1, 17, 400, 23, 9, 1200, 5]], device=device)
    infopt.optimize(m, [Paged(block_size=block_size)])
    before = kernel_calls()
    out = m.generate(prompt, max_new_tokens=16, do_sample=False)
    calls = 16 * m.config.num_hidden_layers  # one per layer per forward
    # the device's kernel where it applies (flash-attn's paged kernel reads pages of a multiple of 256 tokens only;
    # the C++ CPU kernel never runs on CUDA tensors), else the torch reference; never SDPA
    want = dict.fromkeys(("cpu", "flash_attn", "triton", "triton_prefill", "reference", "sdpa"), 0)
    want[DEVICES[device].paged_kernel_for(block_size)] = calls
    assert _ran(before) == want
    # bf16: the paged kernels and SDPA round differently; identical up to a near-tie (see the helper)
    assert_greedy_close(ref, prompt, out[0, prompt.shape[1]:].tolist(), 16)