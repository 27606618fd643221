"""The flagship presets take their fast paths, or CI goes red: an export or compile that fails falls back to a slower
path silently for the user (the tokens stay right), so the tests that check tokens alone would stay green.

- ``cpu-fast`` builds its decode step as an AOTInductor package (where this torch has AOTInductor) on every dense
  tiny family and on the default model, for batch 1 and for every batch of 2-32, and no shape fell back;
- ``throughput`` compiles the engine's two step graphs while the recipe is applied, and serves without compiling
  again.
"""

import pytest
import torch

import infopt
from infopt.compile import compile_stats
from infopt.compile.aot import aot_available
from infopt.generate import decoder_for
from infopt.models import MOE_ARCHS, TINY_ARCHS, tiny_model

DENSE = tuple(a for a in TINY_ARCHS if a not in MOE_ARCHS)
PROMPT = torch.tensor([[1, 17, 400, 23, 9, 1200, 5]])


def _assert_cpu_fast_took_the_package(m) -> None:
    stats = compile_stats(m)
    assert stats is not None and stats.warmed_up and stats.compiles >= 1
    assert not stats.aot_failed, stats.aot_failed  # an export that failed would run torch.compile's graph quietly
    assert not stats.eager_shapes, stats.eager_shapes
    if aot_available():
        assert stats.aot >= 1 and stats.aot == len(stats.shapes), stats
    calls = stats.calls
    m.generate(PROMPT, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert stats.calls > calls and stats.compiles_after_warmup == 0  # served by the warmed step
    if stats.aot:  # a batch too (warmup_batch_sizes: auto): one package serves every batch of 2-32, no eager step
        assert any(s.startswith("any batch 2-32") for s in stats.shapes), stats.shapes
        calls = stats.calls
        batch = PROMPT.expand(3, -1)
        m.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=4, min_new_tokens=4,
                   do_sample=False)
        assert stats.calls == calls + 3 and stats.cold_eager_calls == 0 and stats.compiles_after_warmup == 0


@pytest.mark.slow
@pytest.mark.parametrize("arch", DENSE)
def test_cpu_fast_builds_its_package_on_every_family(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("INFOPT_CACHE_DIR", str(tmp_path))  # a cold cache: the export and compile really run
    m = tiny_model(arch, num_kv_heads=1) if arch == "gemma3" else tiny_model(arch)
    infopt.optimize(m, "cpu-fast")
    _assert_cpu_fast_took_the_package(m)


@pytest.mark.real_model
@pytest.mark.slow
def test_cpu_fast_builds_its_package_on_the_default_model(default_model):
    import copy

    model, _ = default_model
    m = copy.deepcopy(model)
    infopt.optimize(m, "cpu-fast")
    _assert_cpu_fast_took_the_package(m)


def _engine_stats(m):
    engine = decoder_for(m).engine
    assert engine is not None, "the throughput preset installs the batching engine"
    forward = engine.engine.core.forward
    assert forward.compiled, "the throughput preset compiles the engine's steps on CPU"
    return forward


@pytest.mark.slow
def test_throughput_compiles_the_engines_two_graphs_while_applied():
    m = infopt.optimize(tiny_model("llama"), "throughput")
    compiled = _engine_stats(m)
    assert compiled.engine_graph.warmed_up and compiled.stats.compiles == 2, compiled.stats.as_dict()
    batch = torch.tensor([[2, 2, 1, 17, 400], [1, 30, 40, 50, 60]])
    out = m.generate(batch, attention_mask=(batch != 2).long(), max_new_tokens=6, do_sample=False, pad_token_id=2)
    assert out.shape == (2, 11)
    assert compiled.stats.compiles == 2 and compiled.stats.compiles_after_warmup == 0, compiled.stats.as_dict()
    assert infopt.generate.routing_stats(m).original == 0
