"""The batching recipe step: padded generate and pipeline(batch_size=N) through the engine, exact; fallbacks;
rules; undo; DynamicBatcher and StaticBatcher."""

from __future__ import annotations

import threading

import pytest
import torch

import infopt
from infopt.batching import Batching, DynamicBatcher, SamplingParams, StaticBatcher, batching_engine, enable_
from infopt.core.errors import RecipeError
from infopt.generate import routing_stats
from infopt.kvcache import Paged, Static
from infopt.models import tiny_model
from tests.batching.helpers import start_queued
from tests.conftest import assert_state_equal, state_snapshot


def _batch():
    ids = torch.tensor([[2, 2, 2, 5, 6, 7], [1, 9, 8, 7, 6, 5], [2, 2, 2, 2, 2, 44]])
    mask = (torch.arange(6)[None] >= torch.tensor([[3], [0], [5]])).long()
    return ids, mask


def test_padded_generate_is_identical_and_undo_restores():
    ref, model = tiny_model(), tiny_model()
    snap = state_snapshot(model)
    ids, mask = _batch()
    infopt.optimize(model, [Batching(num_blocks=64, max_batch_tokens=8)])
    for kw in ({"max_new_tokens": 9}, {"max_new_tokens": 9, "eos_token_id": 17, "pad_token_id": 0},
               {"max_length": 12}, {"max_new_tokens": 6, "min_new_tokens": 6}):
        a = model.generate(ids, attention_mask=mask, do_sample=False, **kw)
        b = ref.generate(ids, attention_mask=mask, do_sample=False, **kw)
        assert torch.equal(a, b), kw
    assert routing_stats(model).infopt == 4
    assert batching_engine(model).cache.allocator.num_used == 0
    infopt.undo(model)
    assert batching_engine(model) is None
    assert "generate" not in model.__dict__ and model.config._attn_implementation == "sdpa"
    assert_state_equal(model, snap)


def test_calls_the_engine_does_not_serve_fall_back_with_a_reason():
    ref, model = tiny_model(), tiny_model()
    enable_(model, Batching(num_blocks=64))
    ids = torch.tensor([[1, 2, 3, 4]])
    for kw, reason in (({"num_beams": 2}, "num_beams"), ({"repetition_penalty": 1.3}, "repetition_penalty"),
                       ({"output_scores": True, "return_dict_in_generate": True}, "output_scores")):
        a = model.generate(ids, max_new_tokens=5, do_sample=False, **kw)
        b = ref.generate(ids, max_new_tokens=5, do_sample=False, **kw)
        a = a if torch.is_tensor(a) else a.sequences
        b = b if torch.is_tensor(b) else b.sequences
        assert torch.equal(a, b)
        assert any(reason in r for r in routing_stats(model).reasons), (reason, routing_stats(model).reasons)
    right = torch.tensor([[1, 1, 0], [1, 1, 1]])
    model.generate(torch.tensor([[5, 6, 0], [7, 8, 9]]), attention_mask=right, max_new_tokens=2, pad_token_id=0)
    assert any("left padding" in r for r in routing_stats(model).reasons)


def test_sampling_through_generate_is_served():
    """A sampled generate call served by the engine draws from the model's filtered distribution: every token is
    among the top 20 of the plain model's logits at its position (teacher-forced over the output, so a wrong cache
    or position shows), the same global seed draws the same tokens, and other seeds other tokens."""
    ref, model = tiny_model(), tiny_model()
    enable_(model, Batching(num_blocks=64))
    prompt, kw = torch.tensor([[1, 2, 3]]), dict(max_new_tokens=6, do_sample=True, temperature=0.7, top_k=20)
    draws = []
    for seed in (0, 0, 1, 2):
        torch.manual_seed(seed)
        draws.append(model.generate(prompt, **kw))
    assert routing_stats(model).infopt == 4
    out = draws[0]
    assert torch.equal(out[:, :3], prompt) and out.shape == (1, 9)
    with torch.no_grad():
        logits = ref(out).logits[0, 2:-1]  # [6, V]: the logits each new token was drawn from
    top20 = logits.topk(20, dim=-1).indices
    assert all(int(t) in top20[i].tolist() for i, t in enumerate(out[0, 3:])), (out, top20[:, :3])
    assert torch.equal(draws[0], draws[1])
    assert not (torch.equal(draws[0], draws[2]) and torch.equal(draws[0], draws[3]))


def test_pipeline_with_batch_size_runs_through_the_engine(default_tokenizer):
    from transformers import pipeline

    ref, model = tiny_model(), tiny_model()
    tok = default_tokenizer
    tok.padding_side = "left"
    texts = ["Hello, my name is", "The cache", "One two three four five six", "Why"]
    kw = {"max_new_tokens": 6, "do_sample": False, "return_full_text": False}
    want = [o[0]["generated_text"] for o in pipeline("text-generation", model=ref, tokenizer=tok)(texts, **kw)]
    infopt.optimize(model, [Batching(num_blocks=64)], tokenizer=tok)
    got = [o[0]["generated_text"] for o in
           pipeline("text-generation", model=model, tokenizer=tok)(texts, batch_size=4, **kw)]
    assert got == want
    assert routing_stats(model).infopt >= 1 and routing_stats(model).original == 0


def test_concurrent_generate_calls_share_engine_steps():
    ref, model = tiny_model(), tiny_model()
    engine = enable_(model, Batching(num_blocks=128))
    prompts = [torch.tensor([[i + 1, i + 2, i + 3]]) for i in range(6)]
    results: dict[int, torch.Tensor] = {}
    def call(i):
        results[i] = model.generate(prompts[i], max_new_tokens=8, do_sample=False)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    start_queued(engine, threads, 6)
    for i, p in enumerate(prompts):
        assert torch.equal(results[i], ref.generate(p, max_new_tokens=8, do_sample=False))
    assert engine.metrics()["steps"] <= 9  # the six calls decoded in the same steps


def test_recipe_rules_and_config_errors():
    with pytest.raises(RecipeError, match="batching cannot be combined with kvcache:static"):
        infopt.validate(tiny_model(), [Batching(), Static()])
    with pytest.raises(RecipeError, match="attention"):
        infopt.validate(tiny_model(), [Batching(), infopt.attention.Attention("eager")])
    with pytest.raises(RecipeError, match="max_seqs=0"):
        Batching(max_seqs=0)
    with pytest.raises(RecipeError, match="chunked_prefill"):
        Batching(chunked_prefill="yes")
    assert infopt.Recipe.parse({"batching": {"max_seqs": 8}}).steps[0] == Batching(max_seqs=8)
    infopt.validate(tiny_model(), [Paged(block_size=8), Batching()])  # paged + batching compose


def test_kvcache_paged_step_sizes_the_engine():
    model = tiny_model()
    infopt.optimize(model, [Paged(block_size=8, num_blocks=40), Batching()])
    eng = batching_engine(model)
    assert eng.cache.block_size == 8 and eng.cache.allocator.num_blocks == 40


def test_dynamic_batcher_gathers_threads_into_one_forward():
    model = tiny_model()
    calls = []

    def fwd(**batch):
        calls.append(batch["input_ids"].shape[0])
        return model(**batch).logits

    items = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    results = {}
    with DynamicBatcher(fwd, max_batch_size=4, timeout_ms=60_000) as batcher:  # closes only when full
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, batcher(items[i]))) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert calls == [4] and batcher.mean_batch_size == 4
    with torch.no_grad():
        for i, it in enumerate(items):
            alone = model(torch.tensor([it])).logits[0]
            torch.testing.assert_close(results[i], alone, rtol=1e-4, atol=1e-5)


def test_dynamic_batcher_moves_collated_tensors_to_its_device():
    seen = []

    def fn(input_ids, attention_mask):
        seen.append((input_ids.device, attention_mask.device))
        return torch.zeros(input_ids.shape, device=input_ids.device)

    with DynamicBatcher(fn, max_batch_size=2, timeout_ms=1, device="meta") as run:  # meta stands in for cuda
        assert run([1, 2, 3]).device.type == "meta"
    assert seen == [(torch.device("meta"), torch.device("meta"))]


def test_dynamic_batcher_timeout_runs_partial_batches_and_propagates_errors():
    def fn(**batch):
        if (batch["input_ids"] == 13).any():
            raise ValueError("bad item")
        return batch["input_ids"] * 2

    with DynamicBatcher(fn, max_batch_size=8, timeout_ms=1) as b:
        assert b([1, 2]).tolist() == [2, 4]  # alone: the timeout closed the batch
        with pytest.raises(ValueError, match="bad item"):
            b([13])
        assert b([3]).tolist() == [6]  # still serving
    with pytest.raises(RuntimeError, match="closed"):
        b.submit([1])
    with pytest.raises(ValueError, match="max_batch_size"):
        DynamicBatcher(fn, max_batch_size=0)


def test_static_batcher_matches_generate():
    ref = tiny_model()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    outs = StaticBatcher(tiny_model(), batch_size=2).generate(prompts, SamplingParams(max_new_tokens=5,
                                                                                      ignore_eos=True))
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == ref.generate(torch.tensor([p]), max_new_tokens=5, min_new_tokens=5,
                                           do_sample=False)[0, len(p):].tolist()


@pytest.mark.slow
def test_throughput_preset_is_exact_and_undoes():
    ref, model = tiny_model(), tiny_model()
    ids, mask = _batch()
    infopt.optimize(model, "throughput")
    assert [s.key for s in model.infopt.steps] == ["kvcache:paged", "compile", "batching"]
    a = model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False)
    assert torch.equal(a, ref.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False))
    assert routing_stats(model).infopt == 1
    infopt.undo(model)
    assert "generate" not in model.__dict__ and model.config._attn_implementation == "sdpa"


def test_batching_step_on_the_device_greedy_and_sampled(device):
    ref, model = tiny_model().to(device), tiny_model().to(device)
    infopt.optimize(model, [Batching(num_blocks=64, max_batch_tokens=8)])
    ids, mask = (t.to(device) for t in _batch())
    a = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert a.device.type == device
    assert torch.equal(a, ref.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False))
    kw = {"attention_mask": mask, "max_new_tokens": 8, "do_sample": True, "temperature": 0.8, "top_k": 20,
          "top_p": 0.9, "pad_token_id": 0}
    torch.manual_seed(0)  # the engine draws each row's seed from torch's global generator
    s1 = model.generate(ids, **kw)
    torch.manual_seed(0)
    s2 = model.generate(ids, **kw)
    assert s1.device.type == device and s1.shape[0] == 3 and torch.equal(s1[:, :6], ids)
    assert torch.equal(s1, s2)
    assert routing_stats(model).infopt == 3 and batching_engine(model).metrics()["errors"] == 0
    infopt.undo(model)


def test_dynamic_batcher_serves_a_model_on_the_device(device):
    model = tiny_model().to(device)
    with DynamicBatcher(lambda **b: model(**b).logits, max_batch_size=4, timeout_ms=2, device=device) as score:
        out = score([1, 2, 3])
    with torch.no_grad():
        want = model(torch.tensor([[1, 2, 3]], device=device)).logits[0]
    assert out.device.type == device and out.shape == want.shape
    torch.testing.assert_close(out, want)
