import pytest
import torch

import infopt
from infopt.core.errors import IncompatibleModelError, RecipeError
from infopt.core.introspect import inspect_model
from infopt.core.patch import has_patches, swap_module
from infopt.core.step import StepConfig
from infopt.io import load_optimized, save_optimized
from infopt.models import tiny_model
from infopt.quantize import AWQ, CALIBRATED, Int4Linear, Int4WeightOnly, Int8Linear, quantize_
from infopt.quantize.algorithms.awq import awq_plan, structure
from infopt.quantize.algorithms.layerwise import targets_by_layer
from infopt.quantize.api import quantize_targets

from ..conftest import assert_state_equal, state_snapshot

VOCAB = 49152
OUTLIERS = torch.tensor([3, 17, 40, 51])


def calib(n=8, seq=64, seed=0):
    return torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed))


def kl(ref_logits, logits):
    p = ref_logits.detach().log_softmax(-1)
    q = logits.detach().log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def with_outliers(arch):
    """A tiny model whose norms amplify a few channels 20x: the activation outliers AWQ exists for."""
    m = tiny_model(arch)
    with torch.no_grad():
        for name, mod in m.named_modules():
            if name.rsplit(".", 1)[-1] in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                                           "ln_1", "ln_2"):
                w = mod.weight
                if arch.startswith("gemma"):  # (1 + w) * n(x)
                    w[OUTLIERS] = (1 + w[OUTLIERS]) * 20 - 1
                else:
                    w[OUTLIERS] *= 20
    return m


@pytest.mark.parametrize("arch", ["llama", "gemma", "gpt2", "phi3", "gemma3"])
def test_fold_keeps_the_float_function(arch):
    """Scales folded into norms / producer rows, weights left in float: the same logits (1e-5)."""
    m = with_outliers(arch)
    x = calib(2, 40, seed=1)
    with torch.no_grad():
        ref = m(x).logits
    cfg = AWQ(group_size=32, samples=8, seq_len=64)
    plan = awq_plan(m, cfg, quantize_targets(m, cfg), calib(), quantize=False)
    before = {f: m.get_submodule(f).weight.detach().clone() for f in plan}
    norms = [f for f in plan if "norm" in f or f.endswith(("ln_1", "ln_2"))]
    assert norms, "no norm was folded into"
    assert any(not torch.equal(plan[f].weight, before[f]) for f in norms), "all scales were 1"
    for fqn, mod in plan.items():
        swap_module(m, fqn, mod)
    with torch.no_grad():
        torch.testing.assert_close(m(x).logits, ref, atol=1e-5, rtol=0)
    infopt.undo(m)
    with torch.no_grad():
        assert torch.equal(m(x).logits, ref)


@pytest.mark.parametrize("arch,expected", [
    ("llama", [("input_layernorm", "scale"), ("self_attn.v_proj", "rows"), ("post_attention_layernorm", "scale"),
               ("mlp.up_proj", "rows")]),
    ("gemma", [("input_layernorm", "offset"), ("self_attn.v_proj", "rows"), ("post_attention_layernorm", "offset"),
               ("mlp.up_proj", "rows")]),
    ("gemma3", [("input_layernorm", "offset"), ("self_attn.v_proj", "rows"), ("pre_feedforward_layernorm", "offset"),
                ("mlp.up_proj", "rows")]),
    ("gpt2", [("ln_1", "scale"), ("attn.c_attn", "rows"), ("ln_2", "scale")]),
    ("phi3", [("input_layernorm", "scale"), ("self_attn.qkv_proj", "rows"), ("post_attention_layernorm", "scale"),
              ("mlp.gate_up_proj", "rows")]),
])
def test_structure_per_family(arch, expected):
    m = tiny_model(arch)
    info = inspect_model(m)
    cfg = AWQ(group_size=32)
    groups = structure(m, info, targets_by_layer(info, quantize_targets(m, cfg)))
    for layer_groups in groups.values():
        assert [(g.prev, g.fold) for g in layer_groups] == expected


def test_excluded_consumer_disables_its_group():
    m = tiny_model("llama")
    cfg = AWQ(group_size=32, samples=4, seq_len=32)
    targets = quantize_targets(m, cfg, exclude=["*.q_proj"])
    plan = awq_plan(m, cfg, targets, calib(4, 32))
    assert "model.layers.0.input_layernorm" not in plan
    assert "model.layers.0.post_attention_layernorm" in plan
    assert "model.layers.0.self_attn.q_proj" not in plan


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_awq_beats_rtn_with_outlier_channels(arch):
    ids, ev = calib(16, 64), calib(4, 64, seed=5)
    with torch.no_grad():
        ref = with_outliers(arch)(ev).logits
        awq = quantize_(with_outliers(arch), AWQ(group_size=32, samples=16, seq_len=64), calibration=ids)
        rtn = quantize_(with_outliers(arch), Int4WeightOnly(group_size=32))
        assert kl(ref, awq(ev).logits) < 0.7 * kl(ref, rtn(ev).logits)


def test_whole_model_quantize_and_undo(prompt):
    m = tiny_model("qwen2")
    ref = m(prompt).logits
    snap = state_snapshot(m)
    norm = m.model.layers[0].input_layernorm
    quantize_(m, AWQ(group_size=32, samples=8, seq_len=64), calibration=calib())
    assert isinstance(m.model.layers[0].self_attn.q_proj, Int4Linear)
    assert m.model.layers[0].self_attn.q_proj.in_perm is None
    assert m.model.layers[0].input_layernorm is not norm  # a folded copy, swapped like the linears
    assert kl(ref, m(prompt).logits) < 0.01
    infopt.undo(m)
    assert m.model.layers[0].input_layernorm is norm
    assert_state_equal(m, snap)
    assert torch.equal(m(prompt).logits, ref)


def test_optimize_route_and_save_reload(tmp_path, prompt):
    m = tiny_model("gemma")
    ref = m(prompt).logits
    infopt.optimize(m, [AWQ(group_size=32, samples=4, seq_len=32)], calibration=calib())
    logits = m(prompt).logits
    assert kl(ref, logits) < 0.01
    save_optimized(m, tmp_path / "saved")
    m2, _ = load_optimized(tmp_path / "saved")
    assert isinstance(m2.model.layers[1].mlp.down_proj, Int4Linear)
    assert torch.equal(m2(prompt).logits, logits)


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_bfloat16_model(arch, prompt):
    m = tiny_model(arch, dtype=torch.bfloat16)
    ref = m(prompt).logits.float()
    quantize_(m, AWQ(group_size=32, samples=4, seq_len=32), calibration=calib())
    assert m.model.layers[0].input_layernorm.weight.dtype == torch.bfloat16
    assert kl(ref, m(prompt).logits.float()) < 0.01


def test_int8(prompt):
    m = tiny_model("gpt2")
    ref = m(prompt).logits
    quantize_(m, AWQ(bits=8, group_size=-1, samples=4, seq_len=32), calibration=calib())
    assert isinstance(m.transformer.h[0].mlp.c_fc, Int8Linear)
    assert kl(ref, m(prompt).logits) < 1e-3


def test_plan_does_not_mutate(llama):
    snap = state_snapshot(llama)
    mods = dict(llama.named_modules())
    cfg = AWQ(group_size=32, samples=4, seq_len=32)
    plan = CALIBRATED[AWQ](llama, cfg, quantize_targets(llama, cfg), calib(4, 32), False)
    assert len(plan) == 14 + 4  # the linears, and two norms per layer
    assert_state_equal(llama, snap)
    assert dict(llama.named_modules()) == mods
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in llama.modules())


def test_bad_group_size_refused_before_mutation():
    m = tiny_model("llama", hidden_size=576, num_heads=9, num_kv_heads=3, num_layers=1)
    snap = state_snapshot(m)
    with pytest.raises(IncompatibleModelError, match=r"in_features=576; use group_size 64 or 32"):
        infopt.optimize(m, [AWQ(group_size=128, samples=2, seq_len=16)], calibration=calib())
    assert_state_equal(m, snap)
    assert not has_patches(m)


@pytest.mark.parametrize("field,value", [("bits", 2), ("group_size", 100), ("group_size", -1), ("samples", 0),
                                         ("seq_len", 0), ("grid", 0), ("grid", 2.5), ("symmetric", "no")])
def test_bad_fields(field, value):
    with pytest.raises(RecipeError, match=f"AWQ.{field}="):
        AWQ(**{field: value})


def test_recipe_spelling():
    step = StepConfig.from_dict({"quantize": {"method": "awq", "bits": 4, "group_size": 64, "grid": 10}})
    assert step == AWQ(group_size=64, grid=10)
    assert StepConfig.from_dict(step.to_dict()) == step
