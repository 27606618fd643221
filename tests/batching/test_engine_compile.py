"""The engine's compiled step (``Engine(compile=True)``): greedy identity with plain generate, two graphs compiled by
the warm-up and none while serving, undo, the eager fallback when compiling fails."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from torch import nn

import infopt
from infopt.batching import Engine, SamplingParams
from infopt.compile.packed_step import PackedGraph, is_compile_error
from infopt.kvcache import Paged
from infopt.models import tiny_model


def _prompts(n: int, seed: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 4000) for _ in range(rng.randint(1, hi))] for _ in range(n)]


def _solo(model, prompt: list[int], new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


def _linear_forwards(model: nn.Module) -> int:
    return sum("forward" in m.__dict__ for m in model.modules() if isinstance(m, nn.Linear))


@pytest.mark.slow
def test_compiled_engine_greedy_matches_generate_with_two_graphs_and_none_while_serving():
    ref = tiny_model("llama")
    model = tiny_model("llama")
    assert _linear_forwards(model) == 0
    eng = Engine(model, max_batch_tokens=48, max_seqs=12, kv=Paged(block_size=4, num_blocks=120), compile=True)
    stats = eng.metrics()["compile"]
    assert stats["compiles"] == 2 and stats["compiles_after_warmup"] == 0 and not stats["eager_shapes"]
    assert eng.metrics()["steps"] == 0  # the warm-up's steps are not counted
    rng = random.Random(1)
    prompts = _prompts(24, seed=2, hi=90)
    lengths = [rng.randint(1, 20) for _ in prompts]
    # a small budget and pool: prompts chunked across steps, sequences preempted, steps of one and of many
    # sequences, one and many due rows, block tables of one and of many blocks
    outs = eng.generate(prompts, [SamplingParams(max_new_tokens=n) for n in lengths])
    for p, n, o in zip(prompts, lengths, outs, strict=True):
        assert o.token_ids == _solo(ref, p, n), (len(p), n)
    single = eng.generate([[7]], SamplingParams(max_new_tokens=3))[0]
    assert single.token_ids == _solo(ref, [7], 3)
    stats = eng.metrics()["compile"]
    assert stats["compiles"] == 2 and stats["compiles_after_warmup"] == 0, stats
    assert stats["calls"] > eng.metrics()["steps"] // 2
    assert stats["shapes"] == ["engine step, 1 token", "engine step, 2+ tokens, any sequences"], stats
    # q/k/v and gate/up fused, the linears on packed weights through the custom operator (where oneDNN packs)
    assert _linear_forwards(model) >= 4 * model.config.num_hidden_layers
    assert "_infopt_fused" in model.model.layers[0].self_attn.q_proj.__dict__
    eng.stop()
    infopt.undo(model)
    assert _linear_forwards(model) == 0
    assert "_infopt_fused" not in model.model.layers[0].self_attn.q_proj.__dict__
    assert model.config._attn_implementation != "infopt_paged"


@pytest.mark.slow
def test_a_hook_added_after_compiling_runs_in_the_next_steps():
    # dynamo's module guards are skipped; the engine's own per-step check must notice the change and compile again
    ref = tiny_model("llama")
    model = tiny_model("llama")
    eng = Engine(model, max_batch_tokens=32, max_seqs=4, kv=Paged(block_size=4, num_blocks=64), compile=True)
    prompts = _prompts(3, seed=7, hi=12)
    before = [_solo(ref, p, 6) for p in prompts]
    for m in (ref, model):  # negate the final hidden states: each greedy token becomes the least likely one
        m.model.norm.register_forward_hook(lambda mod, args, out: -out)
    expected = [_solo(ref, p, 6) for p in prompts]
    assert expected != before  # the hook changes the tokens, so a stale graph would show
    eager = eng.metrics()["compile"]["eager_calls"]
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=6))
    assert [o.token_ids for o in outs] == expected
    stats = eng.metrics()["compile"]
    assert stats["compiles"] > 2 and stats["eager_calls"] == eager, stats  # compiled again, not run eagerly


def test_compile_failure_falls_back_to_eager_steps_with_a_warning(monkeypatch, caplog):
    def broken(self, gm, example_inputs):  # dynamo raises this as a BackendCompilerFailed
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(PackedGraph, "_compiler", broken)
    ref = tiny_model("llama")
    model = tiny_model("llama")
    with caplog.at_level(logging.WARNING, logger="infopt.compile"):
        eng = Engine(model, max_batch_tokens=32, max_seqs=4, kv=Paged(block_size=4, num_blocks=64), compile=True)
    assert any("failed to compile" in r.getMessage() for r in caplog.records)
    stats = eng.metrics()["compile"]
    assert "no compiler here" in stats["eager_shapes"]["engine step"] and stats["compiles"] == 0
    prompts = _prompts(4, seed=5, hi=20)
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=6))
    assert [o.token_ids for o in outs] == [_solo(ref, p, 6) for p in prompts]
    assert eng.metrics()["compile"]["eager_calls"] >= eng.metrics()["steps"]


def test_a_forward_error_is_not_taken_for_a_compile_error():
    assert is_compile_error(RuntimeError("shape mismatch")) is False


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_compile_must_be_a_bool(bad):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="compile="):
        Engine(model, kv=Paged(num_blocks=16), compile=bad)
    assert model.config._attn_implementation != "infopt_paged"  # refused before anything changed


@pytest.mark.slow
def test_compiled_engine_on_the_reference_attention_matches_generate_greedy():
    # what a GPU without flash-attn runs: the reference paged attention inside the compiled graph, as one operator
    # (its per-step Python split cannot be traced with dynamic shapes: SDPA refused a symbolic is_causal)
    from infopt.attention.paged import set_cpu_kernel

    ref = tiny_model("llama")
    model = tiny_model("llama")
    previous = set_cpu_kernel(False)
    try:
        eng = Engine(model, max_batch_tokens=48, max_seqs=8, kv=Paged(block_size=16, num_blocks=64), compile=True)
        prompts = _prompts(8, seed=3, hi=60)
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=12))
        single = eng.generate([[7]], SamplingParams(max_new_tokens=3))[0]
        stats = eng.metrics()["compile"]
        eng.stop()
    finally:
        set_cpu_kernel(previous)
    assert [o.token_ids for o in outs] == [_solo(ref, p, 12) for p in prompts]
    assert single.token_ids == _solo(ref, [7], 3)
    assert stats["compiles"] == 2 and stats["compiles_after_warmup"] == 0 and not stats["eager_shapes"], stats


@pytest.mark.slow
def test_compiled_engine_on_the_device_matches_generate_greedy(device):
    ref = tiny_model("llama").to(device)
    model = tiny_model("llama").to(device)
    eng = Engine(model, max_batch_tokens=48, max_seqs=8, kv=Paged(block_size=16, num_blocks=64), compile=True)
    prompts = _prompts(8, seed=3, hi=60)
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=12))
    assert [o.token_ids for o in outs] == [_solo(ref, p, 12) for p in prompts]
    stats = eng.metrics()["compile"]
    assert stats["compiles"] == 2 and stats["compiles_after_warmup"] == 0 and not stats["eager_shapes"], stats


def test_batching_compile_field_is_gone_with_advice():
    from infopt.batching import Batching
    from infopt.core.errors import RecipeError

    for make in (lambda: Batching(compile="auto"), lambda: infopt.Recipe.parse([{"batching": {"compile": True}}])):
        with pytest.raises(RecipeError, match="batching.compile was removed: the compile stage decides"):
            make()


@pytest.mark.slow
def test_a_compile_step_beside_batching_compiles_the_engines_steps_with_its_settings():
    ref = tiny_model("llama")
    model = tiny_model("llama")
    recipe = [{"kvcache": {"kind": "paged", "num_blocks": 64, "block_size": 4}},
              {"compile": {"fuse_projections": False}}, {"batching": {"max_seqs": 4, "max_batch_tokens": 32}}]
    infopt.optimize(model, recipe)
    stats = infopt.compile.compile_stats(model)  # the compile step's stats count the engine's graphs
    assert stats is not None and stats.compiles == 2 and stats.shapes == [
        "engine step, 1 token", "engine step, 2+ tokens, any sequences"], stats.as_dict()
    assert "_infopt_fused" not in model.model.layers[0].self_attn.q_proj.__dict__  # fuse_projections: false
    prompts = _prompts(3, seed=11, hi=20)
    batch = torch.nn.utils.rnn.pad_sequence([torch.tensor(p[::-1]) for p in prompts], batch_first=True,
                                            padding_value=0).flip(1)  # left padding
    out = model.generate(batch, attention_mask=(batch != 0).long(), max_new_tokens=5, do_sample=False,
                         pad_token_id=0)
    for b, p in enumerate(prompts):
        assert out[b, batch.shape[1]:].tolist() == _solo(ref, p, 5), b
    assert stats.compiles == 2 and stats.compiles_after_warmup == 0 and stats.calls > 0, stats.as_dict()
    infopt.undo(model)
    assert infopt.compile.compile_stats(model) is None and _linear_forwards(model) == 0
