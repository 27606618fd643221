"""A quantize step's error bound (``max_kl``): measured when applied, held by keeping what breaks it in higher precision,
said in the report, and carried by a saved recipe (infopt.quantize.bound)."""

import pytest
import torch

import infopt
from infopt.compile import compile_stats
from infopt.core.errors import RecipeError
from infopt.eval import logit_metrics
from infopt.models import tiny_model
from infopt.quantize import Int4WeightOnly, Int8WeightOnly, quantize_
from infopt.quantize.api import keep_level, quantize_targets, target_config
from infopt.quantize.bound import BOUND_TOKENS, _logits_in_rows, fit_bound, int8_activations
from infopt.quantize.calibration.data import calibration_ids
from infopt.quantize.formats import a8
from infopt.quantize.formats.int4 import Int4Linear
from infopt.quantize.formats.int8 import Int8Linear

a8_kernel = pytest.mark.skipif(not a8.available(), reason="the C++ int8-activation kernel cannot be built here")


def _plant_mlp_outlier(m, layer: int, channel: int = 3, k: float = 300.0) -> None:
    """One intermediate channel of an MLP ``k`` times larger, its down_proj column ``k`` times smaller: the model
    computes the same function, but down_proj's input has an outlier its int8 activations and int4 groups lose."""
    mlp = m.model.layers[layer].mlp
    with torch.no_grad():
        mlp.up_proj.weight[channel] *= k
        mlp.down_proj.weight[:, channel] /= k


def _plant_norm_outlier(m, layer: int, channel: int = 5, k: float = 1000.0) -> None:
    """One channel of the attention's input norm ``k`` times larger and the q/k/v weights reading it zero: q/k/v
    compute what they did without that channel, but their input has an outlier that per-group int8 activations round
    the rest of its group against, while their (symmetric int4) weights lose nothing more to it."""
    attn = m.model.layers[layer].self_attn
    with torch.no_grad():
        m.model.layers[layer].input_layernorm.weight[channel] *= k
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.weight[:, channel] = 0.0


def _cfg(**kw):
    base = dict(group_size=32, include_lm_head=True, share_embedding=True, activations="int8")
    base.update(kw)
    return Int4WeightOnly(**base)


@pytest.mark.parametrize("entry", ["lm_head", "lm_head=fp32", "=float", "*.down_proj=int4"])
def test_a_malformed_keep_entry_is_refused_by_name(entry):
    with pytest.raises(RecipeError, match="keep entry") as e:
        Int4WeightOnly(group_size=32, keep=(entry,))
    assert "float-activations, int8, float" in str(e.value)


@pytest.mark.parametrize("bound", [0, -0.1, "0.02", True])
def test_a_bound_that_is_no_positive_number_is_refused(bound):
    with pytest.raises(RecipeError, match="max_kl"):
        Int8WeightOnly(max_kl=bound)


def test_keep_entries_pick_each_layers_format_the_last_match_winning():
    cfg = Int4WeightOnly(group_size=32, include_lm_head=True,
                         keep=("*.down_proj=int8", "model.layers.1.mlp.down_proj=float", "lm_head=float",
                               "*.q_proj=float-activations"))
    assert keep_level(cfg, "model.layers.0.mlp.down_proj") == "int8"
    assert keep_level(cfg, "model.layers.1.mlp.down_proj") == "float"
    assert target_config(cfg, "lm_head", "lm_head") is None
    m = quantize_(tiny_model(), cfg)
    layers = m.model.layers
    assert isinstance(layers[0].mlp.down_proj, Int8Linear)
    assert type(layers[1].mlp.down_proj) is torch.nn.Linear
    assert type(m.lm_head) is torch.nn.Linear
    assert isinstance(layers[0].mlp.up_proj, Int4Linear)
    q = layers[0].self_attn.q_proj
    assert isinstance(q, Int4Linear) and not int8_activations(q)


@a8_kernel
def test_a_bound_the_quantized_model_keeps_leaves_every_layer_as_configured():
    m = tiny_model(num_layers=3)
    cfg, fit, layers = fit_bound(m, _cfg(max_kl=1e-3))
    assert fit.held and fit.kept == {} and cfg.keep == () and fit.tries == 1
    assert fit.kl == fit.kl_quantized <= 1e-3
    assert all(isinstance(v, (Int4Linear, Int8Linear)) for v in layers.values())
    assert "nothing kept" in fit.notes()[0]


@a8_kernel
def test_an_mlp_outlier_breaking_the_bound_keeps_that_layer_and_the_bound_holds():
    m = tiny_model(num_layers=3)
    _plant_mlp_outlier(m, layer=1)
    before = {n: p.clone() for n, p in m.state_dict().items()}
    cfg, fit, _ = fit_bound(m, _cfg(max_kl=1e-4))
    # the model itself is untouched by the fit (its trial swaps are undone)
    assert all(torch.equal(before[n], p) for n, p in m.state_dict().items())
    assert all(type(mod) is torch.nn.Linear for n, mod in m.named_modules() if n.endswith("_proj"))
    assert fit.kl_quantized > 1e-4, "the planted outlier must break the bound for this test to mean anything"
    assert "model.layers.1.mlp.down_proj" in fit.kept
    assert len(fit.kept) <= 2, fit.kept  # the search keeps what the measurement asks, not a whole class of layers
    assert fit.held and fit.kl <= 1e-4
    assert cfg.keep == tuple(f"{k}={v}" for k, v in fit.kept.items())
    # applied, the model measures what the fit said (the same text, the decode kernels)
    ids = calibration_ids(m, None, samples=1, seq_len=BOUND_TOKENS)
    with torch.inference_mode():
        ref = m(ids, use_cache=False).logits
    infopt.optimize(m, {"steps": [{"quantize": cfg.to_dict()["quantize"]}]})
    with torch.inference_mode():
        got = logit_metrics(_logits_in_rows(m, ids), ref)["kl"]
    assert got == pytest.approx(fit.kl, rel=1e-3, abs=1e-7)
    assert not isinstance(m.model.layers[1].mlp.down_proj, Int4Linear) or not int8_activations(
        m.model.layers[1].mlp.down_proj)


@a8_kernel
def test_an_activation_outlier_drops_int8_activations_before_touching_the_weights():
    m = tiny_model(num_layers=3)
    _plant_norm_outlier(m, layer=2)
    cfg, fit, _ = fit_bound(m, _cfg(max_kl=1e-4, symmetric=True))
    assert fit.kl_quantized > 1e-4
    assert fit.held
    planted = {k: v for k, v in fit.kept.items()
               if k in {f"model.layers.2.self_attn.{p}_proj" for p in ("q", "k", "v")}}
    assert planted and set(planted.values()) == {"float-activations"}, fit.kept
    assert all("largest value" in fit.why[k] for k in planted)


@a8_kernel
def test_optimize_reports_what_it_kept_and_a_saved_model_loads_the_same_layers(tmp_path):
    m = tiny_model(num_layers=3)
    _plant_mlp_outlier(m, layer=1)
    infopt.optimize(m, {"steps": [{"quantize": _cfg(max_kl=1e-4).to_dict()["quantize"]}]})
    step = m.infopt.steps[0]
    bound = step.stats["bound"]
    assert bound["max_kl"] == 1e-4 and bound["kl"] <= 1e-4 < bound["kl_quantized"]
    assert "model.layers.1.mlp.down_proj" in bound["kept"]
    notes = "\n".join(step.notes)
    assert "kept" in notes and "model.layers.1.mlp.down_proj" in notes
    assert step.config["quantize"]["keep"], "the recipe the report records carries the kept layers"
    infopt.save_optimized(m, tmp_path / "m")
    loaded, _ = infopt.load(tmp_path / "m")
    types = {n: type(mod).__name__ for n, mod in m.named_modules() if n.endswith(("_proj", "lm_head"))}
    assert {n: type(mod).__name__ for n, mod in loaded.named_modules() if n.endswith(("_proj", "lm_head"))} == types
    ids = torch.tensor([[1, 5, 9, 14, 2]])
    with torch.inference_mode():
        assert torch.equal(m(ids).logits, loaded(ids).logits)
    # loading rebuilds from the recipe's keep entries, without measuring again
    assert "bound" not in loaded.infopt.steps[0].stats


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_weight_only_configs_hold_a_bound_on_every_device(device, method):
    m = tiny_model(num_layers=2).to(device)
    _plant_mlp_outlier(m, layer=0, k=3000.0)
    cfg = (Int4WeightOnly(group_size=32, max_kl=1e-5) if method == "int4"
           else Int8WeightOnly(group_size=32, max_kl=1e-7))
    new, fit, layers = fit_bound(m, cfg)
    assert fit.kl_quantized > cfg.max_kl and fit.held, fit.notes()
    assert set(layers) == {t.fqn for t in quantize_targets(m, cfg)}  # every target has its layer (None: float)
    quantize_(m, new, layers=layers)
    for fqn, level in fit.kept.items():
        mod = m.get_submodule(fqn)
        assert (type(mod) is torch.nn.Linear) == (level == "float")


def test_a_model_the_default_tokenizer_does_not_fit_gets_a_clear_error_and_stays_untouched():
    m = tiny_model(vocab_size=1000)
    with pytest.raises(RecipeError, match="tokenizer"):
        infopt.optimize(m, {"steps": [{"quantize": {"method": "int4", "group_size": 32, "max_kl": 0.02}}]})
    assert all(type(mod) is torch.nn.Linear for n, mod in m.named_modules() if n.endswith("_proj"))
    # with ids that fit, it measures on them
    ids = torch.randint(0, 1000, (1, BOUND_TOKENS), generator=torch.Generator().manual_seed(0))
    infopt.optimize(m, {"steps": [{"quantize": {"method": "int4", "group_size": 32, "max_kl": 0.02}}]},
                    calibration=ids)
    assert m.infopt.steps[0].stats["bound"]["tokens"] == BOUND_TOKENS


@a8_kernel
@pytest.mark.slow
def test_a_model_with_kept_layers_compiles_and_decodes_the_tokens_it_decodes_eagerly():
    # q/k/v of one layer in three formats (no fused projection across them), an int8 down_proj, a float head
    keep = ("model.layers.0.self_attn.v_proj=float-activations", "model.layers.0.self_attn.k_proj=int8",
            "model.layers.1.mlp.down_proj=float", "lm_head=float")
    q = _cfg(keep=keep).to_dict()["quantize"]
    eager = tiny_model()
    infopt.optimize(eager, [{"quantize": q}])
    m = tiny_model()
    infopt.optimize(m, [{"quantize": q}, {"kvcache": {"kind": "static"}},
                        {"compile": {"mode": "default", "warmup_lengths": [64]}}])
    ids = torch.randint(0, m.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(0))
    want = eager.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(m.generate(ids, max_new_tokens=12, do_sample=False), want)
    stats = compile_stats(m)
    assert stats.calls >= 11 and stats.compiles_after_warmup == 0 and stats.eager_calls == 0
