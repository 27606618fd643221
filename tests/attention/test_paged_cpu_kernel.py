"""infopt's C++ paged-attention kernel against the torch reference kernel (the oracle)."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import infopt
from infopt.attention.paged import _reference_packed, kernel_calls, set_cpu_kernel
from infopt.batching import Engine, SamplingParams
from infopt.kvcache import Paged, PagedCache
from infopt.models import tiny_model
from infopt.ops import cpp

pytestmark = pytest.mark.skipif(not cpp.load("paged_attention"),
                                reason=f"the C++ kernel cannot be built here: {cpp.status()['paged_attention']}")


def _layout(news, kv_lens, block_size, h_kv, d, dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(nbs) + 3
    k = torch.randn(num_blocks, block_size, h_kv, d, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, h_kv, dv, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(news), max(nbs), dtype=torch.long)
    used = 0
    for s, nb in enumerate(nbs):  # blocks scattered over the pool, rows padded with block 0
        table[s, :nb] = perm[used:used + nb]
        used += nb
    return k, v, table


def _oracle(q, k, v, table, news, kv_lens, scale, window=0):
    """Per query: softmax over the keys up to its own position (the last ``window`` of them), in float64."""
    h, h_kv, bs = q.shape[1], k.shape[2], k.shape[1]
    out = torch.zeros(q.shape[0], h, v.shape[-1], dtype=torch.float64)
    start = 0
    for s, (n, length) in enumerate(zip(news, kv_lens, strict=True)):
        nb = -(-length // bs)
        ks = k[table[s, :nb]].reshape(-1, h_kv, k.shape[-1])[:length].double()
        vs = v[table[s, :nb]].reshape(-1, h_kv, v.shape[-1])[:length].double()
        ks = ks.repeat_interleave(h // h_kv, dim=1)  # [L, H, D]
        vs = vs.repeat_interleave(h // h_kv, dim=1)
        for i in range(n):
            p = length - n + i
            lo = max(0, p - window + 1) if window else 0
            w = (torch.einsum("hd,lhd->hl", q[start + i].double(), ks[lo:p + 1]) * scale).softmax(-1)
            out[start + i] = torch.einsum("hl,lhd->hd", w, vs[lo:p + 1])
        start += n
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       kv_dtype=st.sampled_from([None, torch.float32, torch.bfloat16, torch.float16]),
       heads=st.sampled_from([(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 1, 24), (4, 2, 16)]),
       block_size=st.sampled_from([1, 4, 16, 100, 256]), int32_table=st.booleans(),
       window=st.sampled_from([0, 0, 1, 5, 64, 300]))
def test_kernel_matches_oracle(data, dtype, kv_dtype, heads, block_size, int32_table, window):
    """Decode tokens, prefill chunks after earlier chunks and fresh prefills, any block size, GQA groups, head sizes
    on and off the unrolled paths, both table dtypes; few or many sequences (so the key-split path runs too); with
    and without a sliding window (starting inside tiles, blocks and split parts); K/V in the query's dtype or in
    another (fp32, bf16, fp16 pools under fp32 or bf16 queries)."""
    h, h_kv, d = heads
    s = data.draw(st.integers(1, 6))
    news = data.draw(st.lists(st.integers(1, 40), min_size=s, max_size=s))
    kv_lens = [n + data.draw(st.integers(0, 700)) for n in news]
    k, v, table = _layout(news, kv_lens, block_size, h_kv, d, d, kv_dtype or dtype, seed=data.draw(st.integers(0, 99)))
    q = torch.randn(sum(news), h, d).to(dtype)
    starts = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()])
    scale = 1 / math.sqrt(d)
    out = torch.ops.infopt.paged_attention(q, k, v, table.int() if int32_table else table, starts,
                                           torch.tensor(kv_lens), scale, window)
    assert out.dtype == dtype and out.shape == (sum(news), h, d)
    ref = _oracle(q, k, v, table, news, kv_lens, scale, window)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("heads", [(24, 8, 128), (14, 2, 64), (8, 8, 128)], ids=["g3-d128", "g7-d64", "g1-d128"])
@pytest.mark.parametrize("split_keys", [True, False], ids=["any-order", "fixed-order"])
def test_decode_rows_match_oracle(kv_dtype, heads, split_keys):
    """Decode steps (one query per sequence) over long contexts: the three-pass path (every score, one softmax,
    then the values; split over threads) and the fixed-order tile path give the oracle's result, fp32 queries over
    fp32 or 16-bit K/V, GQA groups of 1 to 7 rows; one sequence (its keys split) and five."""
    h, h_kv, d = heads
    for kv_lens in ([1500], [700, 33, 1, 260, 1029]):
        news = [1] * len(kv_lens)
        k, v, table = _layout(news, kv_lens, 16, h_kv, d, d, kv_dtype, seed=3)
        q = torch.randn(len(news), h, d)
        starts = torch.arange(len(news) + 1)
        out = torch.ops.infopt.paged_attention(q, k, v, table, starts, torch.tensor(kv_lens), d ** -0.5, 0, split_keys)
        torch.testing.assert_close(out.double(), _oracle(q, k, v, table, news, kv_lens, d ** -0.5), atol=1e-5,
                                   rtol=1e-5)


@pytest.mark.parametrize("window", [None, 20], ids=["full", "window20"])
def test_kernel_equals_reference_kernel_on_a_packed_step(window):
    """The same metadata the paged cache builds, through both kernels."""
    from infopt.attention.paged import PagedAttentionMetadata

    news, kv_lens, bs = [1, 1, 7, 1, 30], [40, 3, 7, 129, 95], 16
    k, v, table = _layout(news, kv_lens, bs, 2, 32, 32, torch.float32, seed=1)
    q = torch.randn(1, 4, sum(news), 32)
    n = torch.tensor(news)
    off = n.cumsum(0) - n
    gather = off[:, None] + torch.minimum(torch.arange(n.max())[None], n[:, None] - 1)
    meta = PagedAttentionMetadata(block_size=bs, block_table=table, kv_lens=torch.tensor(kv_lens),
                                  query_pos=torch.zeros_like(gather), mask=None, gather=gather, scatter=None,
                                  token_index=None, new_lens=n)
    ref = _reference_packed(q, k, v, meta, 0.2, window)
    out = torch.ops.infopt.paged_attention(q[0].transpose(0, 1), k, v, table, meta.query_start(), meta.kv_lens, 0.2,
                                           window or 0)
    torch.testing.assert_close(out[None], ref, atol=1e-5, rtol=1e-5)
    if window:
        oracle = _oracle(q[0].transpose(0, 1), k, v, table, news, kv_lens, 0.2, window)
        torch.testing.assert_close(out.double(), oracle, atol=1e-5, rtol=1e-5)


def test_bad_layout_is_a_clear_error():
    k, v, table = _layout([1], [20], 16, 2, 32, 32, torch.float32, seed=0)
    q = torch.randn(1, 4, 32)
    with pytest.raises(RuntimeError, match="inconsistent with its block table"):
        torch.ops.infopt.paged_attention(q, k, v, table, torch.tensor([0, 1]), torch.tensor([500]), 0.1)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.infopt.paged_attention(q.half(), k, v, table, torch.tensor([0, 1]), torch.tensor([20]), 0.1)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_greedy_identical_with_either_kernel(arch):
    """Mixed prefill chunks and decode steps through the engine: the C++ kernel and the reference give the same
    greedy tokens, equal to plain generate."""
    model = tiny_model(arch, max_positions=512)
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(5 + 23 * i)] for i in range(5)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    before = kernel_calls()
    engine = Engine(model, max_batch_tokens=48, max_seqs=4, kv=Paged(num_blocks=64, block_size=8))
    fast = [o.token_ids for o in engine.generate(prompts, params)]
    assert kernel_calls()["cpu"] > before["cpu"]
    previous = set_cpu_kernel(False)
    try:
        engine = Engine(model, max_batch_tokens=48, max_seqs=4, kv=Paged(num_blocks=64, block_size=8))
        ref = [o.token_ids for o in engine.generate(prompts, params)]
    finally:
        set_cpu_kernel(previous)
    infopt.undo(model)
    plain = [model.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(p):]
             .tolist() for p in prompts]
    assert fast == ref == plain


def test_bf16_paged_cache_logits_close_to_reference():
    model = infopt.attention.set_backend_(tiny_model("llama", dtype=torch.bfloat16), "paged")
    ids = [3, 9, 27, 81, 243, 7, 21, 63, 189, 55, 165]
    logits = {}
    for kernel in (True, False):
        previous = set_cpu_kernel(kernel)
        try:
            cache = PagedCache.for_model(model, num_blocks=8, block_size=4)
            cache.add_sequence("a", ids)
            with torch.no_grad():
                cache.step(model, [("a", ids[:6])])
                logits[kernel] = cache.step(model, [("a", ids[6:])]).float()
        finally:
            set_cpu_kernel(previous)
    torch.testing.assert_close(logits[True], logits[False], atol=0.05, rtol=0.02)


@pytest.mark.slow
def test_engine_forward_compiled_before_its_first_step(monkeypatch):
    """The engine loads the C++ kernel when it starts: a forward compiled before any eager step traces the kernel
    (dynamo cannot enter the loader's lock) and gives the eager engine's tokens."""
    import torch._dynamo

    prompts = [[(3 * i + j) % 150 + 1 for j in range(5 + 7 * i)] for i in range(2)]
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    ref = tiny_model("llama", max_positions=256)
    eager = [o.token_ids for o in Engine(ref, max_batch_tokens=32, max_seqs=4,
                                         kv=Paged(num_blocks=64, block_size=8)).generate(prompts, params)]

    monkeypatch.delitem(cpp._STATE, "paged_attention", raising=False)  # as in a process that ran no paged attention yet
    model = tiny_model("llama", max_positions=256)
    engine = Engine(model, max_batch_tokens=32, max_seqs=4, kv=Paged(num_blocks=64, block_size=8))
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, fullgraph=True, dynamic=True)
    try:
        outs = engine.generate(prompts, params)
    finally:
        del model.forward
        torch._dynamo.reset()
        infopt.undo(model)
    assert [o.error for o in outs] == [None, None]
    assert [o.token_ids for o in outs] == eager


@pytest.mark.slow
def test_packed_step_forward_compiles_as_one_graph():
    """The engine's forward (layout as the paged_step keyword, K/V written and attended by the C++ kernel) traces
    into one graph: compile-ready, and the compiled step gives the eager tokens."""
    import torch._dynamo

    model = tiny_model("llama", max_positions=256)
    prompts = [[(5 * i + j) % 200 + 1 for j in range(4 + 9 * i)] for i in range(3)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine = Engine(model, max_batch_tokens=32, max_seqs=4, kv=Paged(num_blocks=64, block_size=8))
    eager = [o.token_ids for o in engine.generate(prompts, params)]
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, fullgraph=True, dynamic=True)  # a graph break fails here
    try:
        compiled = [o.token_ids for o in engine.generate(prompts, params)]
    finally:
        del model.forward  # the instance attribute: the class's forward again
        torch._dynamo.reset()
        infopt.undo(model)
    assert compiled == eager
