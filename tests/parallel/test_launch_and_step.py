"""``launch`` itself, the ``parallel`` recipe step's validation, and the errors without a process group."""

import pytest
import torch

import infopt
from infopt.core.errors import IncompatibleModelError, RecipeError
from infopt.core.step import STEP_TYPES, TRANSFORMS
from infopt.models import tiny_model
from infopt.parallel import Parallel, check_pipeline, launch, pipeline_parallel_, plan_tensor_parallel, tensor_parallel_
from infopt.recipe import Recipe
from tests.conftest import assert_state_equal, state_snapshot

from . import workers


@pytest.mark.slow
def test_failed_rank_error_carries_its_traceback():
    with pytest.raises(RuntimeError, match="rank1 failed") as e:
        launch(workers.raise_on_rank1, nprocs=2)
    assert "ValueError: rank one broke on purpose" in str(e.value)


@pytest.mark.parametrize("kwargs, match", [
    ({"nprocs": 0}, "positive integer"),
    ({"backend": "mpi"}, "allowed: gloo, nccl"),
])
def test_launch_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        launch(workers.raise_on_rank1, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_nccl_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="needs CUDA devices and none is visible; use backend='gloo'"):
        launch(workers.raise_on_rank1, nprocs=1, backend="nccl")


def test_without_process_group_model_untouched():
    m = tiny_model("llama")
    snap = state_snapshot(m)
    for call in (lambda: tensor_parallel_(m), lambda: pipeline_parallel_(m, stages=2),
                 lambda: infopt.optimize(m, {"parallel": {"tensor": 2}})):
        with pytest.raises(IncompatibleModelError, match="needs an initialized torch.distributed process group"):
            call()
    assert_state_equal(m, snap)
    assert not infopt.core.has_patches(m)


def test_recipe_spelling_round_trips():
    for spelling in ({"parallel": {"tensor": 3}}, {"parallel": {"pipeline": 2, "micro_batches": 2}}):
        r = Recipe.parse({"steps": [spelling]})
        step = r.steps[0]
        assert isinstance(step, Parallel) and step.key == "parallel"
        assert Recipe.from_yaml(r.to_yaml()) == r


@pytest.mark.parametrize("fields, match", [
    ({}, "exactly one of them"),
    ({"tensor": 2, "pipeline": 2}, "exactly one of them"),
    ({"tensor": 0}, "Parallel.tensor=0"),
    ({"pipeline": "two"}, "Parallel.pipeline='two'"),
    ({"tensor": 2, "micro_batches": 0}, "micro_batches"),
    ({"tensor": 2, "vocab_parallel": "yes"}, "vocab_parallel"),
    ({"expert": 0}, "Parallel.expert=0"),
    ({"expert": 2, "tensor": 2}, "exactly one of them"),
    ({"expert": 2, "dispatch": "ring"}, "allowed: all_to_all, all_reduce"),
])
def test_bad_fields_are_recipe_errors(fields, match):
    with pytest.raises(RecipeError, match=match):
        Parallel.from_dict({"parallel": fields})


def test_registered_beside_its_transform():
    assert STEP_TYPES["parallel"] == {None: Parallel}
    assert Parallel in TRANSFORMS
    assert set(infopt.parallel.__all__) >= {"Parallel", "tensor_parallel_", "pipeline_parallel_", "launch"}


@pytest.mark.parametrize("heads, kv, world, ok", [(4, 2, 2, True), (9, 3, 3, True), (9, 3, 2, False), (4, 1, 2, False)])
def test_planner_checks_heads_and_kv_heads(heads, kv, world, ok):
    m = tiny_model("llama", hidden_size=heads * 8, num_heads=heads, num_kv_heads=kv)
    if ok:
        plan = plan_tensor_parallel(m, world)
        assert (plan.heads_per_rank, plan.kv_heads_per_rank) == (heads // world, kv // world)
        assert {s for _, s in plan.layers} == {"colwise", "rowwise"} and len(plan.layers) == 7 * 2
    else:
        with pytest.raises(IncompatibleModelError, match="World sizes that work for this model: 1"):
            plan_tensor_parallel(m, world)


def test_planner_rejects_bad_plans_and_vocab():
    m = tiny_model("llama", vocab_size=1001)
    with pytest.raises(IncompatibleModelError, match="matches no projection"):
        plan_tensor_parallel(m, 2, plan={"self_attn.qkv": "colwise"})
    with pytest.raises(IncompatibleModelError, match="allowed: 'colwise', 'rowwise'"):
        plan_tensor_parallel(m, 2, plan={"self_attn.q_proj": "diagonal"})
    assert not plan_tensor_parallel(m, 2).vocab_parallel  # 1001 does not split in 2: replicated
    with pytest.raises(IncompatibleModelError, match="vocab_size=1001"):
        plan_tensor_parallel(m, 2, vocab_parallel=True)


def test_pipeline_checks():
    with pytest.raises(IncompatibleModelError, match="3 stages for 2 decoder layers"):
        check_pipeline(tiny_model("llama"), 3)
    with pytest.raises(IncompatibleModelError, match="mixes layer types"):
        check_pipeline(tiny_model("gemma3", num_layers=6), 2)
    with pytest.raises(IncompatibleModelError, match="supports model types"):
        check_pipeline(tiny_model("gpt2"), 2)


@pytest.mark.parametrize("method", ["bnb_int8", "bnb_nf4", "smoothquant"])
def test_rules_refuse_quantizers_tensor_parallel_cannot_split(method):
    with pytest.raises(RecipeError, match=f"parallel cannot be combined with quantize:{method}"):
        Recipe.parse([{"parallel": {"tensor": 2}}, {"quantize": {"method": method}}])
    # pipeline keeps whole layers, so any quantizer composes with it
    assert [s.key for s in Recipe.parse([{"parallel": {"pipeline": 2}}, {"quantize": {"method": method}}]).steps] == [
        f"quantize:{method}", "parallel"]


@pytest.mark.parametrize("name", ["dist", "expert", "launch", "pipeline", "step", "tensor"])
def test_docstring_examples_run(name):
    import doctest
    import importlib

    module = importlib.import_module(f"infopt.parallel.{name}")
    res = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert res.attempted > 0 and res.failed == 0
