"""Tensor parallelism on 2 (tiny models) and 3 (default model) CPU processes with gloo, against one process."""

import pytest

from infopt.parallel import launch
from infopt.quantize.formats import a8

from . import workers

TINY_CASES = ("llama", "qwen2", "gemma", "llama-bias", "llama-dtensor", "llama-bias-dtensor", "llama-bf16",
              "llama-int8", "llama-int8-g32", "llama-int4", *(("llama-int8-a8", "llama-int4-a8") if a8.available() else ()))


@pytest.fixture(scope="module")
def tiny_results():
    ranks = launch(workers.tp_tiny_families, nprocs=2)
    assert ranks[0] == ranks[1], "every rank must see the same logits and tokens"
    return ranks[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", TINY_CASES)
def test_two_rank_tp_matches_one_process(tiny_results, case):
    r = tiny_results[case]
    # fp32 and int8 (fp32 compute): only the summation order changes. bf16, and int4's fused kernel (bf16 output),
    # round each rank's partial output to bf16 before the all-reduce: logits move by ~bf16 precision
    assert r["rel_err"] < (1e-2 if case.endswith(("int4", "bf16", "a8")) else 1e-4)
    assert r["tokens_equal"] and r["n_tokens"] == workers.NEW_TOKENS


@pytest.mark.parametrize("case", TINY_CASES)
def test_each_rank_holds_half_and_undo_restores(tiny_results, case):
    r = tiny_results[case]
    # gemma's scaled embedding is split too (vocab-parallel), so every case holds ~1/2 of the weights
    assert r["vocab_parallel"]
    assert 0.49 < r["bytes_ratio"] < 0.51
    assert r["undo_logits_equal"] and r["undo_state_equal"]


def test_layers_swapped_per_kind(tiny_results):
    assert (tiny_results["llama"]["q_proj"], tiny_results["llama"]["o_proj"]) == ("Linear", "RowParallel")
    assert tiny_results["llama-dtensor"]["q_proj_dtensor"] and not tiny_results["llama"]["q_proj_dtensor"]
    assert (tiny_results["llama-dtensor"]["q_proj"], tiny_results["llama-dtensor"]["o_proj"]) == ("Linear", "Linear")
    assert (tiny_results["llama-int8"]["q_proj"], tiny_results["llama-int8"]["o_proj"]) == ("Int8Linear", "RowParallel")
    assert (tiny_results["llama-int4"]["q_proj"], tiny_results["llama-int4"]["o_proj"]) == ("Int4Linear", "RowParallel")


@pytest.mark.skipif(not a8.available(), reason="the C++ quant_linear kernel cannot be built here")
def test_shards_keep_int8_activations(tiny_results):
    # a shard is built in its layer's kernel layout, not the device's automatic one (which dropped int8 activations)
    assert tiny_results["llama-int4-a8"]["q_proj_kernel"] == tiny_results["llama-int4-a8"]["o_proj_kernel"] == "a8"
    assert tiny_results["llama-int8-a8"]["q_proj_kernel"] == tiny_results["llama-int8-a8"]["o_proj_kernel"] == "a8"


@pytest.fixture(scope="module")
def refusal_results():
    return launch(workers.refusals_and_recipe, nprocs=2)[0]


@pytest.mark.slow
def test_heads_not_divisible_refused_with_sizes_that_work(refusal_results):
    r = refusal_results["refusals"]
    for key in ("heads", "heads_recipe"):
        assert r[key].startswith("IncompatibleModelError")
        assert "num_attention_heads=9, num_key_value_heads=3" in r[key]
        assert "World sizes that work for this model: 1, 3" in r[key]
    assert r["heads_untouched"]


def test_bitsandbytes_refused_with_reason(refusal_results):
    r = refusal_results["refusals"]
    assert r["bnb"].startswith("IncompatibleModelError") and "bitsandbytes" in r["bnb"]
    assert "packed formats" in r["bnb"] and "'int8' or 'int4'" in r["bnb"]
    assert r["bnb_untouched"]


def test_size_and_family_refusals(refusal_results):
    r = refusal_results["refusals"]
    assert "must equal the world size of the process group, 2" in r["size_mismatch"]
    assert "torchrun --nproc-per-node 3" in r["size_mismatch"]
    assert "stages=3" in r["stages_mismatch"] and "world size 2" in r["stages_mismatch"]
    assert "no plan for model_type 'gpt2'" in r["gpt2"]
    assert "already tensor-parallel over 2 ranks; call infopt.undo(model) first" in r["twice"]
    assert r["untouched"]


def test_recipe_step_composes_with_static_cache(refusal_results):
    r = refusal_results["recipe"]
    assert r["steps"] == ["parallel", "kvcache:static"]
    assert r["tokens_equal"]
    assert r["stats"]["world"] == 2 and r["stats"]["local_bytes_after"] < 0.51 * r["stats"]["local_bytes_before"]
    assert "tensor parallel over 2 ranks" in r["notes"][0]


@pytest.mark.real_model
@pytest.mark.slow
def test_default_model_three_ranks_fp32_and_int8(default_model):
    """The default model (9 heads, 3 KV heads: 2 ranks cannot split it) over 3 ranks. The single-process
    references are computed once here (int8 on the session model, undone afterwards) and sent to the ranks."""
    import infopt

    model = default_model[0]
    refs = {}
    try:
        for name, quant in workers.default_cases().items():
            refs[name] = workers.reference(model, quant)
    finally:
        infopt.undo(model)
    ranks = launch(workers.default_model_tp, nprocs=3, args=(refs,))
    assert ranks[0] == ranks[1] == ranks[2]
    for name, r in ranks[0].items():
        assert r["rel_err"] < 1e-4, name
        assert r["tokens_equal"] and r["n_tokens"] == workers.NEW_TOKENS, name
        assert 0.33 < r["bytes_ratio"] < 0.34, name  # 1/3 of every weight, embedding and head included
        assert r["undo_logits_equal"] and r["undo_state_equal"], name


@pytest.mark.slow
def test_world_of_one_on_the_devices_backend(device):
    from tests.devices import DEVICES

    r = launch(workers.world_of_one, nprocs=1, backend=DEVICES[device].dist_backend, args=(device,))[0]
    assert r["rel_err"] < 1e-4 and r["tokens_equal"]
    assert r["undo_state_equal"]
