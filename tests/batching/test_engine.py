"""The continuous-batching engine: greedy exactness against generate, chunked prefill, preemption, streaming,
cancellation, stop strings, seeded sampling, bad input, metrics."""

from __future__ import annotations

import asyncio
import doctest
import random

import pytest
import torch

from infopt.batching import Engine, SamplingParams, engine, params, scheduler
from infopt.generate import sampling as sampler
from infopt.kvcache import Paged
from infopt.models import tiny_model
from tests.attention.helpers import assert_greedy_close


def _prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 4000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _solo(model, prompt: list[int], new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma"])
def test_greedy_matches_generate_alone_32_mixed_requests(arch):
    ref = tiny_model(arch)
    model = tiny_model(arch)
    rng = random.Random(1)
    prompts = _prompts(32, seed=2, hi=90)
    lengths = [rng.randint(1, 24) for _ in prompts]
    # a small budget and pool: prompts are chunked across steps and sequences get preempted
    eng = Engine(model, max_batch_tokens=48, max_seqs=12, kv=Paged(block_size=4, num_blocks=120))
    outs = eng.generate(prompts, [SamplingParams(max_new_tokens=n) for n in lengths])
    for p, n, o in zip(prompts, lengths, outs, strict=True):
        assert o.token_ids == _solo(ref, p, n), (arch, len(p), n)
        assert o.finish_reason in ("length", "stop")
    m = eng.metrics()
    assert m["finished"] == 32 and m["errors"] == 0
    assert m["preemptions"] > 0, "the pool was sized to force preemption"
    assert eng.cache.allocator.num_used == 0  # every block released
    eng.cache.allocator.check_invariants()


def test_chunked_prefill_splits_long_prompts_and_interleaves_decoding():
    model = tiny_model()
    eng = Engine(model, max_batch_tokens=16, max_seqs=4, prefill_chunk=8, kv=Paged(block_size=4, num_blocks=64))
    short = eng.submit([5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True))
    eng.step()  # the short prompt prefills and gets its first token
    long = eng.submit(list(range(10, 60)), SamplingParams(max_new_tokens=2, ignore_eos=True))
    steps_with_both = 0
    while not long.done():
        running = {s.rid for s in eng.scheduler.running}
        eng.step()
        steps_with_both += {short.request_id, long.request_id} <= running
    assert steps_with_both >= 3  # the 50-token prompt took several 8-token chunks while the short one decoded
    assert long.result().token_ids == _solo(tiny_model(), list(range(10, 60)), 2)
    assert short.result().token_ids == _solo(tiny_model(), [5, 6, 7], 6)


def test_without_chunked_prefill_a_prompt_is_prefilled_in_one_step():
    eng = Engine(tiny_model(), max_batch_tokens=16, max_seqs=4, chunked_prefill=False,
                 kv=Paged(block_size=4, num_blocks=64))
    h = eng.submit(list(range(10, 50)), SamplingParams(max_new_tokens=3, ignore_eos=True))
    eng.step()
    assert h._seq.computed == 40  # longer than the budget: it ran alone, whole
    assert h.result().token_ids == _solo(tiny_model(), list(range(10, 50)), 3)


def test_prefix_cache_hits_are_reported_and_exact():
    ref, model = tiny_model(), tiny_model()
    system = list(range(100, 164))
    eng = Engine(model, max_batch_tokens=128, kv=Paged(block_size=16, num_blocks=64))
    first = eng.generate([system + [7, 8]], SamplingParams(max_new_tokens=4))[0]
    second = eng.generate([system + [9, 10, 11]], SamplingParams(max_new_tokens=4))[0]
    assert first.metrics.cached_tokens == 0
    assert second.metrics.cached_tokens == 64
    assert second.token_ids == _solo(ref, system + [9, 10, 11], 4)


def test_stream_yields_tokens_in_order_and_matches_result():
    eng = Engine(tiny_model(), kv=Paged(num_blocks=32))
    h = eng.submit([1, 2, 3, 4], SamplingParams(max_new_tokens=7, ignore_eos=True))
    other = eng.submit([9, 9], SamplingParams(max_new_tokens=3, ignore_eos=True))
    streamed = list(h.stream())
    assert streamed == h.result().token_ids and len(streamed) == 7
    assert len(other.result().token_ids) == 3


def test_stream_text_with_tokenizer(default_tokenizer):
    model = tiny_model()
    eng = Engine(model, default_tokenizer, kv=Paged(num_blocks=32))
    h = eng.submit("Hello there, how", SamplingParams(max_new_tokens=6, ignore_eos=True))
    pieces = list(h.stream(text=True))
    assert "".join(pieces) == h.result().text
    assert h.result().text == default_tokenizer.decode(h.result().token_ids, skip_special_tokens=True)


def test_stop_strings_cut_text_and_end_the_request(default_tokenizer):
    model = tiny_model()
    eng = Engine(model, default_tokenizer, kv=Paged(num_blocks=64))
    free = eng.generate(["The"], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    # a stop string taken from the middle of the unconstrained output
    stop = default_tokenizer.decode(free.token_ids[4:6], skip_special_tokens=True).strip()
    assert stop
    out = eng.generate(["The"], SamplingParams(max_new_tokens=12, ignore_eos=True, stop=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert stop not in out.text and free.text.startswith(out.text)
    assert out.token_ids == free.token_ids[:len(out.token_ids)] and len(out.token_ids) <= 6


def test_cancel_stops_a_request_and_frees_its_blocks():
    eng = Engine(tiny_model(), kv=Paged(block_size=4, num_blocks=64))
    keep = eng.submit([1, 2, 3], SamplingParams(max_new_tokens=20, ignore_eos=True))
    gone = eng.submit([4, 5, 6], SamplingParams(max_new_tokens=20, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert gone.cancel()
    out = gone.result()
    assert out.finish_reason == "cancelled" and 0 < len(out.token_ids) < 20
    assert keep.result().finish_reason == "length" and len(keep.result().token_ids) == 20
    assert not gone.cancel()  # already finished
    assert eng.cache.allocator.num_used == 0


def test_eos_and_min_new_tokens_follow_generate():
    ref, model = tiny_model(), tiny_model()
    prompts = _prompts(8, seed=5)
    eos = _solo(ref, prompts[0], 3)[1]  # a token the model emits early, used as EOS
    eng = Engine(model, kv=Paged(num_blocks=64))
    first_lengths = []
    for min_new in (0, 4):
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=10, eos_token_ids=(eos,), min_new_tokens=min_new))
        for p, o in zip(prompts, outs, strict=True):
            g = ref.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=min_new, eos_token_id=eos,
                             pad_token_id=eos, do_sample=False)[0, len(p):].tolist()
            if eos in g:
                g = g[:g.index(eos) + 1]
            assert o.token_ids == g
            assert o.finish_reason == ("stop" if o.token_ids[-1] == eos else "length")
        first_lengths.append(len(outs[0].token_ids))
    assert first_lengths[0] <= 2 and first_lengths[1] >= 5  # EOS ended it at once, then was masked for 4 tokens


def test_seeded_sampling_does_not_depend_on_the_batch():
    sp = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=50, top_p=0.95, seed=123, ignore_eos=True)
    alone = Engine(tiny_model(), kv=Paged(num_blocks=64)).generate([[1, 2, 3]], sp)[0]
    eng = Engine(tiny_model(), kv=Paged(num_blocks=64))
    crowd = eng.generate([[7, 7, 7, 7], [1, 2, 3], [5]], [SamplingParams(12, temperature=1.0, seed=1), sp,
                                                         SamplingParams(12, temperature=0.5, seed=2)])
    assert crowd[1].token_ids == alone.token_ids
    other_seed = eng.generate([[1, 2, 3]], SamplingParams(12, temperature=0.9, top_k=50, top_p=0.95, seed=124,
                                                         ignore_eos=True))[0]
    assert other_seed.token_ids != alone.token_ids


def test_bad_requests_get_clear_errors_and_the_engine_keeps_serving():
    eng = Engine(tiny_model(), kv=Paged(block_size=4, num_blocks=8))  # 32 tokens of KV
    good = eng.submit([1, 2, 3], SamplingParams(max_new_tokens=5, ignore_eos=True))
    with pytest.raises(ValueError, match="empty prompt"):
        eng.submit([], SamplingParams(max_new_tokens=5))
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        eng.submit(list(range(1, 40)), SamplingParams(max_new_tokens=5))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.submit([1, 10**7], SamplingParams(max_new_tokens=5))
    with pytest.raises(ValueError, match="needs a tokenizer"):
        eng.submit("text", SamplingParams(max_new_tokens=5))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        eng.submit([1], SamplingParams(max_new_tokens=5, stop=("x",)))
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        eng.generate([[1]], [SamplingParams(), SamplingParams()])
    assert good.result().token_ids == _solo(tiny_model(), [1, 2, 3], 5)
    assert eng.metrics()["finished"] == 1


def test_a_failing_forward_fails_that_steps_requests_only():
    model = tiny_model()
    eng = Engine(model, kv=Paged(num_blocks=64))
    real_forward = model.forward
    calls = {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real_forward(*a, **k)

    model.forward = flaky
    try:
        bad = eng.submit([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True))
        eng.step()
        good = eng.submit([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True))
        assert bad.result().finish_reason == "error" and "boom" in bad.result().error
        assert good.result().token_ids == _solo(tiny_model(), [1, 2, 3], 4)
    finally:
        del model.forward
    assert eng.cache.allocator.num_used == 0


def test_background_thread_and_async_api():
    eng = Engine(tiny_model(), kv=Paged(num_blocks=64))
    prompts = _prompts(5, seed=9)
    with eng:
        assert eng.is_running()
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=5))
        aouts = asyncio.run(eng.agenerate(prompts, SamplingParams(max_new_tokens=5)))

        async def collect():
            h = eng.submit(prompts[0], SamplingParams(max_new_tokens=5))
            return [t async for t in h.astream()], await h.aresult()

        streamed, res = asyncio.run(collect())
    assert not eng.is_running()
    assert [o.token_ids for o in outs] == [o.token_ids for o in aouts]
    assert streamed == res.token_ids == outs[0].token_ids


def test_async_without_thread_is_a_clear_error():
    eng = Engine(tiny_model(), kv=Paged(num_blocks=16))
    h = eng.submit([1, 2], SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="engine.start"):
        asyncio.run(h.aresult())


def test_metrics_per_request_and_aggregate():
    eng = Engine(tiny_model(), kv=Paged(num_blocks=64))
    out = eng.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    m = out.metrics
    assert m.prompt_tokens == 4 and m.output_tokens == 6
    assert 0 <= m.queue_time <= m.ttft <= m.latency and m.tpot > 0
    agg = eng.metrics()
    assert agg["decode_tokens"] == 5 and agg["prefill_tokens"] == 4
    assert 0 < agg["kv_util_max"] <= 1 and agg["steps"] == 6


def test_engine_config_errors():
    with pytest.raises(ValueError, match="max_seqs=0"):
        Engine(tiny_model(), max_seqs=0)
    with pytest.raises(ValueError, match="kv="):
        Engine(tiny_model(), kv="paged")


def test_top_p_keeps_the_smallest_set_reaching_p():
    x = torch.tensor([2.0, 1.0, 0.5, -1.0])
    kept = ~sampler.filter_logits(x, top_p=0.7).isinf()
    probs = x.softmax(-1)
    assert kept.tolist() == [True, True, False, False] and probs[0] < 0.7 <= probs[:2].sum()


def test_sampled_requests_draw_from_a_generator_on_the_engine_device(monkeypatch):
    eng = Engine(tiny_model(), kv=Paged(num_blocks=32))
    assert eng.device == torch.device("cpu")
    h = eng.submit([1, 2, 3], SamplingParams(4, temperature=0.8, seed=5))
    assert h._seq.generator.device == eng.device
    assert eng.submit([1, 2, 3], SamplingParams(4))._seq.generator is None  # greedy: no generator
    # no GPU here: pretend the model is on cuda:1 and record where the engine asks for the generator
    made = []
    monkeypatch.setattr(engine, "make_generator",
                        lambda device, seed: made.append((device, seed)) or torch.Generator().manual_seed(seed))
    eng.device = torch.device("cuda", 1)
    eng.submit([1, 2, 3], SamplingParams(4, temperature=0.8, seed=9))
    assert made == [(torch.device("cuda", 1), 9)]


def test_make_generator_builds_the_generator_on_the_device(monkeypatch):
    class FakeGenerator:  # torch.Generator(device="cuda") needs a CUDA build
        def __init__(self, device):
            self.device = device

        def manual_seed(self, seed):
            self.seed = seed
            return self

    monkeypatch.setattr(sampler.torch, "Generator", FakeGenerator)
    g = sampler.make_generator("cuda:1", 7)
    assert (g.device, g.seed) == (torch.device("cuda", 1), 7)
    monkeypatch.undo()
    a, b = sampler.make_generator("cpu", 7), sampler.make_generator(torch.device("cpu"), 7)
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))


def test_choose_tokens_mixes_greedy_and_sampled_rows_and_leaves_the_logits_alone():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    greedy, hot = SamplingParams(), SamplingParams(temperature=0.9, top_k=40, top_p=0.9)
    eos = int(logits[0].argmax())
    rows = sampler.choose_tokens(logits, [greedy, hot, greedy, hot],
                                 [None, sampler.make_generator("cpu", 1), None, sampler.make_generator("cpu", 2)],
                                 [[eos, 3], None, None, [eos]])
    assert torch.equal(logits, before)  # the eos mask is applied to a copy
    assert rows[0] == int(logits[0].masked_fill(torch.isin(torch.arange(300), torch.tensor([eos, 3])),
                                                -float("inf")).argmax())
    assert rows[2] == int(logits[2].argmax())
    for i, seed, mask in ((1, 1, []), (3, 2, [eos])):  # each sampled row draws as it would alone
        alone = sampler.choose_tokens(logits[i:i + 1], [hot], [sampler.make_generator("cpu", seed)], [mask or None])
        assert rows[i] == alone[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_matches_generate_on_the_device(dtype, device):
    ref, model = tiny_model(dtype=dtype).to(device), tiny_model(dtype=dtype).to(device)
    rng = random.Random(4)
    prompts = _prompts(10, seed=6, hi=70)
    lengths = [rng.randint(1, 16) for _ in prompts]
    # chunked prefill, decoders and prefills sharing steps, preemption
    eng = Engine(model, max_batch_tokens=32, max_seqs=6, kv=Paged(block_size=4, num_blocks=60))
    assert eng.device.type == device and eng.cache.device.type == device
    outs = eng.generate(prompts, [SamplingParams(max_new_tokens=n) for n in lengths])
    assert eng.metrics()["errors"] == 0 and eng.cache.allocator.num_used == 0
    for p, n, o in zip(prompts, lengths, outs, strict=True):
        if dtype == torch.float32:  # fp32: the paged kernels and SDPA round alike enough for identity
            assert o.token_ids == _solo(ref, p, n), (len(p), n)
        else:  # bf16: identical up to a near-tie (see assert_greedy_close for the tolerance)
            assert_greedy_close(ref, p, o.token_ids, n)


def test_seeded_sampling_on_the_device_is_reproducible(device):
    eng = Engine(tiny_model().to(device), kv=Paged(num_blocks=64))
    sp = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=50, top_p=0.95, seed=123, ignore_eos=True)
    h = eng.submit([1, 2, 3], sp)
    assert h._seq.generator.device.type == device  # the request's generator draws where its logits are
    alone = h.result().token_ids
    assert len(alone) == 12 and eng.generate([[1, 2, 3]], sp)[0].token_ids == alone  # same seed, same tokens
    first = _solo(tiny_model().to(device), [7, 7, 7, 7], 1)[0]
    crowd = eng.generate([[7, 7, 7, 7], [1, 2, 3], [5]], [
        SamplingParams(8, eos_token_ids=(first,), min_new_tokens=4),  # greedy, its EOS masked on the device logits
        sp, SamplingParams(12, temperature=0.5, seed=2)])
    assert crowd[1].token_ids == alone  # the seed alone decides: not the batch around it
    assert first not in crowd[0].token_ids[:4] and len(crowd[0].token_ids) >= 5
    other = eng.generate([[1, 2, 3]], SamplingParams(12, temperature=0.9, top_k=50, top_p=0.95, seed=124,
                                                     ignore_eos=True))[0]
    assert other.token_ids != alone
    assert eng.metrics()["errors"] == 0


@pytest.mark.parametrize("module", [engine, params, sampler, scheduler], ids=lambda m: m.__name__.split(".")[-1])
def test_docstring_examples(module):
    res = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert res.attempted > 0 and res.failed == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_choice_is_fp32_argmax_ties_included(dtype):
    """Greedy rows pick in the logits' dtype; the token equals generate's argmax over fp32 logits, ties included."""
    from infopt.generate.sampling import choose_tokens

    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (16, 50), generator=g).to(dtype)  # many ties per row
    logits[3, 7] = logits[3, 40] = 9  # a tie at the max
    picks = choose_tokens(logits, [SamplingParams()] * 16, [None] * 16, [None] * 16)
    assert picks == logits.float().argmax(-1).tolist()
    assert picks[3] == 7
    masked = choose_tokens(logits, [SamplingParams()] * 16, [None] * 16, [[7]] + [None] * 15)
    ref = logits.float().clone()
    ref[0, 7] = -float("inf")
    assert masked == ref.argmax(-1).tolist() and logits[0, 7] != -float("inf")  # masking works on a copy


def test_each_step_records_its_blocks_once(monkeypatch):
    """The scheduler allocated each step's blocks, so it alone completes them (the cache only closes its layout):
    one ``KVBlockManager.complete`` per step, each over that step's sequences."""
    from infopt.kvcache.manager import KVBlockManager

    calls = []
    real = KVBlockManager.complete

    def spy(self, ids):
        ids = list(ids)
        calls.append(ids)
        return real(self, ids)

    monkeypatch.setattr(KVBlockManager, "complete", spy)
    engine = Engine(tiny_model("llama"), max_batch_tokens=16, max_seqs=4, kv=Paged(num_blocks=64, block_size=8))
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [42, 7]]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [5, 5, 5]
    assert len(calls) == engine.stats["steps"] and all(calls)
