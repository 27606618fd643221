"""Every preset on every mixture-of-experts family: it applies and generates, a lossless one decodes plain
``generate``'s greedy tokens, a compiled one its uncompiled recipe's, and ``undo`` restores the weights bit for bit."""

import pytest
import torch

import infopt
from infopt.compile import compile_stats
from infopt.core.errors import IncompatibleModelError
from infopt.core.patch import has_patches
from infopt.generate import routing_stats
from infopt.models import MOE_ARCHS, tiny_model
from infopt.recipe import PRESETS, Recipe

from .conftest import assert_state_equal, state_snapshot

# head_dim 64 (memory-saver's int4 KV cache groups 64 channels of a head; the default tiny shape has 16), GQA kept
SHAPE = dict(hidden_size=128, num_heads=2, num_kv_heads=1)
CPU_PRESETS = [name for name in PRESETS if name != "gpu-fast"]
# Inductor takes ~10 s per decode graph on this 2-core class of machine, several graphs for a speculative recipe:
# one family compiles with it; on the others dynamo traces the same decode step (the experts' custom op included)
# and runs it without generating kernels, which is what differs between families.
INDUCTOR_ARCH = "mixtral"
IDS = torch.randint(3, 1000, (1, 12), generator=torch.Generator().manual_seed(1))
NEW = 16


def _steps(name: str, arch: str) -> list[dict]:
    steps = [dict(s) for s in PRESETS[name].steps]
    if arch != INDUCTOR_ARCH:
        steps = [{"compile": {**s["compile"], "backend": "eager"}} if "compile" in s else s for s in steps]
    return steps


def _generate(model):
    return model.generate(IDS, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)


@pytest.mark.slow
@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("name", CPU_PRESETS)
def test_preset_applies_generates_and_undoes(name, arch):
    m = tiny_model(arch, **SHAPE)
    plain = _generate(m)
    snap = state_snapshot(m)
    steps = _steps(name, arch)
    infopt.optimize(m, steps)
    out = _generate(m)
    assert out.shape == plain.shape and torch.equal(out[:, :IDS.shape[1]], IDS)
    assert routing_stats(m).infopt == 1 and routing_stats(m).original == 0  # served by infopt's loops
    if all(s.lossless for s in Recipe.parse(steps).steps):
        assert torch.equal(out, plain)
    if any("compile" in s for s in steps):  # compiled: the same tokens as the recipe without compile
        stats = compile_stats(m)
        assert stats.calls > 0 and not stats.eager_shapes and stats.compiles_after_warmup == 0
        ref = tiny_model(arch, **SHAPE)
        infopt.optimize(ref, [s for s in steps if "compile" not in s])
        assert torch.equal(out, _generate(ref))
    infopt.undo(m)
    assert not has_patches(m)
    assert_state_equal(m, snap)
    assert torch.equal(_generate(m), plain)


@pytest.mark.slow
def test_cpu_fast_moe_saves_and_loads_without_compiled_steps(tmp_path):
    """A compiled step holds the experts as an op naming this process's live modules, so no compiled steps are
    saved with a quantized MoE model: the loaded model compiles its step again and decodes the same tokens."""
    from infopt.compile.saved import COMPILED_DIR
    from infopt.io import load_optimized, save_optimized

    m = tiny_model(INDUCTOR_ARCH, **SHAPE)
    infopt.optimize(m, "cpu-fast")
    out = _generate(m)
    save_optimized(m, tmp_path / "q")
    assert not (tmp_path / "q" / COMPILED_DIR).exists()
    m2, _ = load_optimized(tmp_path / "q")
    # the same shapes as the original's warm-up (batch 1 and every batch of 2-32), compiled here, none loaded
    assert compile_stats(m2).loaded == 0 and compile_stats(m2).shapes == compile_stats(m).shapes
    assert compile_stats(m2).compiles == compile_stats(m).compiles >= 1
    assert torch.equal(_generate(m2), out)


@pytest.mark.skipif(torch.cuda.is_available(), reason="gpu-fast applies where CUDA is present")
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_gpu_fast_refused_on_cpu_model_untouched(arch):
    m = tiny_model(arch)
    snap = state_snapshot(m)
    with pytest.raises(IncompatibleModelError, match="CUDA graphs; the model is on cpu"):
        infopt.optimize(m, "gpu-fast")
    assert not has_patches(m)
    assert_state_equal(m, snap)
