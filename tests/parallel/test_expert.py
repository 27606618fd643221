"""Expert parallelism over 2 CPU processes with gloo against one process; its errors without a process group."""

import pytest
import torch

import infopt
from infopt.core.errors import IncompatibleModelError
from infopt.models import MOE_ARCHS, tiny_model
from infopt.parallel import Parallel, expert_parallel_, launch, plan_expert_parallel
from infopt.recipe import Recipe
from tests.conftest import assert_state_equal, state_snapshot

from . import workers

CASES = (*workers.EP_ARCHS, "mixtral-all_reduce", "qwen2_moe-all_reduce", "mixtral-batch",
         "qwen2_moe-batch-all_reduce", "mixtral-3", "mixtral-int8", "mixtral-int4")


@pytest.fixture(scope="module")
def results():
    return launch(workers.ep_cases, nprocs=2)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_match_one_process(results, case):
    for rank, r in enumerate(results):
        # fp32 (int8/int4 experts compute in fp32 or return it): only the order of a few sums can change
        assert r[case]["rel_err"] < 1e-5, rank
        assert r[case]["routing_equal"], rank
        assert r[case]["tokens_equal"] and r[case]["n_tokens"] == workers.NEW_TOKENS, rank


@pytest.mark.parametrize("case", CASES)
def test_each_rank_holds_its_experts_and_undo_restores(results, case):
    uneven = case == "mixtral-3"  # 3 experts over 2 ranks: 2 and 1
    assert [r[case]["experts"] for r in results] == ([[0, 2], [2, 3]] if uneven else [[0, 2], [2, 4]])
    for rank, r in enumerate(results):
        want = (2 / 3, 1 / 3)[rank] if uneven else 0.5
        assert r[case]["experts_bytes_ratio"] == pytest.approx(want)
        assert r[case]["other_bytes_equal"]  # router, shared expert, attention: replicated, untouched
        assert r[case]["experts_type"] == "ExpertParallel" and r[case]["blocks_found"] == 2
        assert r[case]["undo_logits_equal"] and r[case]["undo_state_equal"]


def test_quantized_experts_are_sliced_not_requantized(results):
    assert results[0]["mixtral-int8"]["local_type"] == "QuantizedExperts"
    assert results[0]["mixtral-int4"]["local_type"] == "QuantizedExperts"
    assert results[0]["mixtral"]["local_type"] == "MixtralExperts"  # transformers' own experts forward


def test_recipe_with_quantize_static_cache_and_compile(results):
    for r in results:
        rec = r["recipe-int8-static"]
        assert rec["steps"] == ["quantize:int8", "parallel", "kvcache:static"] and rec["tokens_equal"]
        assert "expert parallel over 2 ranks (all_to_all)" in rec["notes"][0]
        assert rec["stats"]["world"] == 2 and rec["stats"]["local_bytes_after"] < rec["stats"]["local_bytes_before"]
        comp = r["recipe-static-compile"]
        assert comp["steps"] == ["parallel", "kvcache:static", "compile"] and comp["tokens_equal"]
        assert comp["graphs_compiled"] > 0 and comp["warnings"] == []  # compiled, no fallback to eager
        for saved in (rec["save_pretrained"], comp["save_pretrained"]):
            assert saved.startswith("CheckpointError") and "cannot write an expert-parallel model" in saved


def test_refusals_under_a_process_group(results):
    r = results[0]["refusals"]
    assert "parallel expert=3 must equal the world size of the process group, 2" in r["size_mismatch"]
    for key in ("dense", "dense_recipe"):
        assert r[key].startswith("IncompatibleModelError") and "('llama') has none" in r[key]
        assert "{parallel: {tensor: N}}" in r[key]
    assert "Use expert parallelism ({parallel: {expert: N}}" in r["tensor_on_moe"]
    assert "already expert-parallel over 2 ranks; call infopt.undo(model) first" in r["twice"]
    assert "Quantize before splitting" in r["quantize_after"]
    assert r["midway"] == "MemoryError: no room for block 2 on purpose"  # the first block's swap was reverted
    assert r["untouched"] and r["undone"]


def test_without_process_group_says_how_to_launch():
    m = tiny_model("mixtral")
    snap = state_snapshot(m)
    for call in (lambda: expert_parallel_(m), lambda: infopt.optimize(m, {"parallel": {"expert": 2}})):
        with pytest.raises(IncompatibleModelError, match=r"needs an initialized torch.distributed process group.*"
                                                         r"torchrun --nproc-per-node N"):
            call()
    assert_state_equal(m, snap)
    assert not infopt.core.has_patches(m)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_plan_splits_experts_and_replicates_routers(arch):
    m = tiny_model(arch)
    plan = plan_expert_parallel(m, 2)
    assert plan.experts_fqns == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
    assert plan.ranges == (((0, 2), (2, 4)),) * 2 and plan.even
    assert "model.layers.0.mlp.gate" in plan.replicated
    assert ("model.layers.0.mlp.shared_expert" in plan.replicated) == (arch == "qwen2_moe")
    assert plan_expert_parallel(m, 3).ranges[0] == ((0, 2), (2, 3), (3, 4)) and not plan_expert_parallel(m, 3).even


def test_plan_refusals():
    with pytest.raises(IncompatibleModelError, match=r"this model \('llama'\) has none.*pipeline: N"):
        plan_expert_parallel(tiny_model("llama"), 2)
    with pytest.raises(IncompatibleModelError, match="has 4 experts; use at most 4 ranks"):
        plan_expert_parallel(tiny_model("mixtral"), 5)
    with pytest.raises(IncompatibleModelError, match="must be a positive integer"):
        plan_expert_parallel(tiny_model("mixtral"), 0)


def test_plan_refuses_experts_with_shared_tensors():
    m = tiny_model("mixtral")
    experts = m.model.layers[0].mlp.experts
    experts.register_buffer("scale", torch.ones(3))  # not one slice per expert
    with pytest.raises(IncompatibleModelError, match=r"experts.scale of shape \(3,\).*\[4, \.\.\.\]"):
        plan_expert_parallel(m, 2)


def test_recipe_spelling_round_trips():
    r = Recipe.parse({"steps": [{"parallel": {"expert": 2, "dispatch": "all_reduce"}}]})
    step = r.steps[0]
    assert isinstance(step, Parallel) and (step.expert, step.dispatch, step.mode, step.size) == (2, "all_reduce",
                                                                                                "expert", 2)
    assert Recipe.from_yaml(r.to_yaml()) == r


def test_bad_dispatch_is_refused_before_anything():
    with pytest.raises(IncompatibleModelError, match="allowed: all_to_all, all_reduce"):
        expert_parallel_(tiny_model("mixtral"), dispatch="ring")


@pytest.mark.slow
def test_world_of_one_on_the_devices_backend(device):
    from tests.devices import DEVICES

    r = launch(workers.expert_parallel_world_of_one, nprocs=1, backend=DEVICES[device].dist_backend, args=(device,))[0]
    for dispatch in ("all_to_all", "all_reduce"):
        assert r[f"{dispatch}_rel_err"] < 1e-5 and r[f"{dispatch}_tokens_equal"], dispatch
    assert r["undo_logits_equal"]
