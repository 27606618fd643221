"""Pipeline parallelism over 2 CPU processes with gloo: same greedy tokens as one process."""

import pytest

from infopt.parallel import launch, stage_bounds

from . import workers

CASES = ("mb4", "mb1", "batch", "qwen2")


@pytest.fixture(scope="module")
def results():
    return launch(workers.pipeline_cases, nprocs=2)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_two_stages_match_one_process(results, case):
    for rank, r in enumerate(results):
        assert r[case]["tokens_equal"], rank
        assert r[case]["rel_err"] < 1e-4, rank


@pytest.mark.parametrize("case", CASES)
def test_each_stage_holds_its_layers_and_undo_restores(results, case):
    assert [r[case]["layers"] for r in results] == [[0, 2], [2, 4]]
    for r in results:
        assert r[case]["layer_bytes_ratio"] == 0.5
        assert r[case]["undo_state_equal"] and r[case]["undo_logits_equal"]


def test_prefill_is_cut_into_micro_batches(results):
    for r in results:
        assert r["mb4"]["prefill_chunks"] == 4  # 7-token prompt, 4 chunks
        assert r["mb1"]["prefill_chunks"] == 1
        assert r["batch"]["prefill_chunks"] == 4  # left padding: the 4-D mask is sliced per chunk


def test_stage_bounds_cover_every_layer_once():
    for n in (1, 2, 5, 30):
        for stages in range(1, n + 1):
            b = stage_bounds(n, stages)
            assert b[0][0] == 0 and b[-1][1] == n
            assert all(b[i][1] == b[i + 1][0] for i in range(stages - 1))
            assert max(e - s for s, e in b) - min(e - s for s, e in b) <= 1


def test_recipe_with_quantize_and_static_cache(results):
    for r in results:
        assert r["recipe-int8-static"]["steps"] == ["quantize:int8", "parallel", "kvcache:static"]
        assert r["recipe-int8-static"]["tokens_equal"]
