import pytest
import torch
import torch.nn.functional as F
from torch import nn

import infopt
from infopt.core.errors import IncompatibleModelError, RecipeError
from infopt.core.patch import has_patches
from infopt.core.step import StepConfig
from infopt.io import load_optimized, save_optimized
from infopt.models import tiny_model
from infopt.quantize import (
    CALIBRATED,
    QAT,
    Int4Linear,
    Int4WeightOnly,
    Int8Linear,
    Int8WeightOnly,
    QATLinear,
    convert_qat_,
    prepare_qat_,
    qat_param_groups,
    quantize_,
)
from infopt.quantize.algorithms.qat_train import distill_loss, teacher_topk
from infopt.quantize.formats.int4 import quantize_int4_grouped
from infopt.recipe import Recipe

from ..conftest import assert_state_equal, state_snapshot

VOCAB = 49152
TARGETS = 14  # tiny llama: 2 layers x (q, k, v, o, gate, up, down)


def calib(n=4, seq=32, seed=0):
    return torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed))


def small(**kw):
    """A QAT config sized for the tiny models: a handful of steps on 4 rows of 32 tokens."""
    base = dict(group_size=32, steps=4, lr=1e-3, batch_size=4, samples=4, seq_len=32)
    return QAT(**{**base, **kw})


def sharp_model(arch="llama"):
    """A tiny model whose linears matter: a random tiny model's near-uniform outputs hardly move under int4
    rounding (KL ~1e-7), so its weights are scaled up (KL of round-to-nearest int4 g32: ~0.02)."""
    m = tiny_model(arch)
    with torch.no_grad():
        for fqn, mod in m.named_modules():
            if isinstance(mod, nn.Linear) and fqn != "lm_head":
                mod.weight.mul_(10)
        m.get_input_embeddings().weight.mul_(10)
    return m


def sqnr_db(ref, x):
    ref, x = ref.detach().float(), x.detach().float()
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - x).pow(2).mean()))


def flags(model):
    """``requires_grad`` of every parameter, ``training`` of every module, by name."""
    return ({n: p.requires_grad for n, p in model.named_parameters()},
            {n: m.training for n, m in model.named_modules()})


def kept_flags(model, before):
    """The flags of the parameters and modules ``model`` still has from ``before``."""
    grad, mode = flags(model)
    return ({n: v for n, v in grad.items() if n in before[0]}, {n: v for n, v in mode.items() if n in before[1]})


def qat_layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, QATLinear)}


# -- the fake-quantized layer ------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, -1), (8, 32)], ids=["int4-g32", "int8-row", "int8-g32"])
def test_forward_is_the_converted_weight_and_the_gradient_goes_straight_through(bits, group_size):
    """Min/max grids (``scales="minmax"``): recomputed from the weight each call, rounding passed straight through."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    q = QATLinear.from_float(lin, QAT(bits=bits, group_size=group_size, scales="minmax"))
    assert q.log_scale is None and [n for n, _ in q.named_parameters()] == ["weight", "bias"]
    x = torch.randn(3, 64)
    wq = q.quantized_weight()
    assert not torch.equal(wq, lin.weight)  # rounded
    if bits == 4:
        c, s, z = quantize_int4_grouped(lin.weight, 32, zero_point="float")
        torch.testing.assert_close(wq, (c.float() - z.repeat_interleave(32, 1)) * s.repeat_interleave(32, 1))
    else:  # int8 keeps fp32 scales: the converted layer stands for exactly this weight
        assert torch.equal(wq, q.to_quantized().dequantize())
    wq_leaf = wq.clone().requires_grad_()
    torch.testing.assert_close(q(x), F.linear(x, wq, lin.bias))
    q(x).square().sum().backward()
    F.linear(x, wq_leaf, lin.bias).square().sum().backward()
    # straight-through: d loss / d weight is the gradient with respect to the rounded weight
    torch.testing.assert_close(q.weight.grad, wq_leaf.grad)
    assert q.bias.grad is not None
    assert lin.weight.grad is None  # the float layer is a source, not a part


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, -1), (8, 32)], ids=["int4-g32", "int8-row", "int8-g32"])
def test_learned_scales_start_at_round_to_nearest_train_and_convert_with_the_learned_grid(bits, group_size):
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    rtn = QATLinear.from_float(lin, QAT(bits=bits, group_size=group_size, scales="minmax"))
    q = QATLinear.from_float(lin, QAT(bits=bits, group_size=group_size))  # scales="learned", the default
    groups = 1 if group_size == -1 else 64 // group_size
    assert q.log_scale.shape == (32, groups) and not q.log_scale.any()
    # at the start: round-to-nearest's grid and codes exactly, and its converted layer
    assert torch.equal(q.quantized_weight(), rtn.quantized_weight())
    assert torch.equal(q.to_quantized().dequantize(), rtn.to_quantized().dequantize())
    # the scales get a gradient through the fake quantization, and the weight its straight-through one
    x = torch.randn(5, 64)
    q(x).square().sum().backward()
    assert q.log_scale.grad is not None and q.log_scale.grad.abs().sum() > 0
    assert q.weight.grad is not None and q.weight.grad.abs().sum() > 0
    # a moved scale: the forward, quantized_weight and the converted layer all use the learned grid
    with torch.no_grad():
        q.log_scale.add_(torch.linspace(-0.3, 0.2, q.log_scale.numel()).view_as(q.log_scale))
    scales, zeros = q.grid()
    torch.testing.assert_close(scales, q.scale0 * q.log_scale.exp())
    wq = q.quantized_weight()
    assert not torch.equal(wq, rtn.quantized_weight())
    torch.testing.assert_close(q(x), F.linear(x, wq, lin.bias))
    real = q.to_quantized()
    if bits == 8:  # fp32 scales: exactly the fake-quantized weight
        assert torch.equal(real.dequantize(), wq)
    else:  # the int4 kernels keep scales in bf16
        step = float(scales.max())
        torch.testing.assert_close(real.dequantize(), wq, rtol=0, atol=step * 2**-4)  # |code - zero| <= 15
    # shrunken scales clip: some codes sit at the ends of the range
    lo, hi = (0, 15) if bits == 4 else (-127, 127)
    codes = q._codes(q._rounding_input(), scales, zeros)
    assert bool(((codes == lo) | (codes == hi)).any())


def test_qat_param_groups_give_the_scales_their_own_learning_rate():
    m = prepare_qat_(tiny_model("llama"), small(lr=1e-3, scale_lr=5e-3))
    weights, scales = qat_param_groups(m)
    layers = qat_layers(m).values()
    assert weights["lr"] == 1e-3 and scales["lr"] == 5e-3
    assert {id(p) for p in weights["params"]} == {id(la.weight) for la in layers}
    assert {id(p) for p in scales["params"]} == {id(la.log_scale) for la in layers}
    m2 = prepare_qat_(tiny_model("llama"), small(scales="minmax"))
    (only,) = qat_param_groups(m2)
    assert len(only["params"]) == TARGETS
    with pytest.raises(RecipeError, match="no QATLinear"):
        qat_param_groups(tiny_model("llama"))


def test_prepare_swaps_targets_freezes_the_rest_and_gradients_flow(prompt):
    m = tiny_model("llama")
    prepare_qat_(m, small())
    layers = qat_layers(m)
    assert len(layers) == TARGETS and m.training
    assert type(m.lm_head) is nn.Linear and m.lm_head.weight is m.model.embed_tokens.weight  # head stays as it was
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    # tiny llama's projections have no bias; each layer's learned scales train too
    assert trainable == {f"{n}.{p}" for n in layers for p in ("weight", "log_scale")}
    out = m(prompt, labels=prompt)
    out.loss.backward()
    assert all(layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0 for layer in layers.values())
    assert all(layer.log_scale.grad is not None for layer in layers.values())
    assert m.model.norm.weight.grad is None and m.model.embed_tokens.weight.grad is None


# -- the fine-tune ----------------------------------------------------------------------------------------
def test_a_few_steps_lower_the_loss_and_beat_round_to_nearest():
    ids = calib()
    m = sharp_model()
    teacher = teacher_topk(m, ids, 4)  # before optimize: the float model's distribution
    infopt.optimize(m, [small(steps=8)], calibration=ids)
    (step,) = m.infopt.steps
    log = step.stats["loss_log"]
    assert step.stats["train_steps"] == len(log) == 8 and step.stats["loss_first"] == log[0]
    assert step.stats["train_tokens"] == 8 * 4 * 32 and step.stats["loss"] == "distill"
    # one batch of all 4 rows each step: the loss on it falls
    assert sum(log[-3:]) / 3 < 0.8 * log[0]
    assert "after 8 QAT steps" in str(m.infopt)
    rtn = quantize_(sharp_model(), Int4WeightOnly(group_size=32))
    with torch.no_grad():
        kl_qat = float(distill_loss(m(ids).logits, *teacher))
        kl_rtn = float(distill_loss(rtn(ids).logits, *teacher))
    assert kl_qat < 0.8 * kl_rtn  # both through the same int4 kernel


def test_next_token_loss_falls():
    m = infopt.optimize(sharp_model(), [small(steps=5, loss="next_token")], calibration=calib())
    log = m.infopt.steps[0].stats["loss_log"]
    assert m.infopt.steps[0].stats["loss"] == "next_token" and log[-1] < log[0]


# -- conversion ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg,rtn", [(QAT(group_size=32), Int4WeightOnly(group_size=32)),
                                     (QAT(group_size=32, zero_point="int", symmetric=True),
                                      Int4WeightOnly(group_size=32, zero_point="int", symmetric=True)),
                                     (QAT(bits=8, group_size=-1), Int8WeightOnly())],
                         ids=["int4-g32", "int4-sym", "int8-row"])
def test_untrained_conversion_is_round_to_nearest_exactly(cfg, rtn, prompt):
    """prepare + convert with no training gives the very layers (types, layouts, kernels, buffers) of
    Int4WeightOnly / Int8WeightOnly."""
    q = convert_qat_(prepare_qat_(tiny_model(), cfg))
    r = quantize_(tiny_model(), rtn)
    for (n, a), (_, b) in zip(q.named_modules(), r.named_modules(), strict=True):
        assert type(a) is type(b), n
        if isinstance(a, Int4Linear):
            assert a.layout == b.layout == "cpu_int4pack"
        if isinstance(a, Int8Linear):
            assert a.compute_dtype == b.compute_dtype and a.group_size == b.group_size
    assert_state_equal(q, state_snapshot(r))
    assert torch.equal(q(prompt).logits, r(prompt).logits)


@pytest.mark.parametrize("cfg,floor", [(QAT(group_size=32), 30), (QAT(bits=8, group_size=-1), 35)],
                         ids=["int4-g32", "int8-row"])
def test_converted_output_matches_the_fake_quantized_model(cfg, floor):
    ids = calib()
    m = tiny_model("qwen2")
    prepare_qat_(m, cfg)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(3):  # move the weights off the float model's
        m(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    m.eval()
    with torch.no_grad():
        fake = m(ids).logits
        convert_qat_(m)
        real = m(ids).logits
    # the kernels take bf16 activations (and int4 scales in bf16): the only difference
    assert sqnr_db(fake, real) > floor
    assert (fake.argmax(-1) == real.argmax(-1)).float().mean() > 0.97


# -- undo, flags, save ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("stage", ["prepared", "trained", "converted"])
def test_undo_restores_the_model_bit_for_bit(arch, stage, prompt):
    m = tiny_model(arch)
    ref = m(prompt).logits
    snap, before = state_snapshot(m), flags(m)
    prepare_qat_(m, small(), keep_original="disk")
    if stage != "prepared":
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        m(prompt, labels=prompt).loss.backward()
        opt.step()
    if stage == "converted":
        convert_qat_(m)
        assert set(flags(m)[1].values()) == {False}  # eval mode, as before prepare_qat_
    infopt.undo(m)
    assert not has_patches(m)
    assert_state_equal(m, snap)
    assert flags(m) == before
    assert torch.equal(m(prompt).logits, ref)


def test_optimize_route_undo_and_save_reload(tmp_path, prompt):
    m = tiny_model("llama")
    ref = m(prompt).logits
    snap, before = state_snapshot(m), flags(m)
    infopt.optimize(m, [small()], calibration=calib())
    assert isinstance(m.model.layers[1].mlp.down_proj, Int4Linear) and not qat_layers(m)
    # requires_grad and eval mode restored after the fine-tune
    grad, mode = kept_flags(m, before)
    assert set(grad.values()) == {True} and "model.norm.weight" in grad and set(mode.values()) == {False}
    logits = m(prompt).logits
    save_optimized(m, tmp_path / "qat")
    m2, _ = load_optimized(tmp_path / "qat")  # the recipe is rebuilt without training, the weights loaded over it
    assert isinstance(m2.model.layers[0].self_attn.q_proj, Int4Linear)
    assert torch.equal(m2(prompt).logits, logits)
    m.save_pretrained(tmp_path / "hf")
    m3, _ = infopt.load(tmp_path / "hf")
    assert torch.equal(m3(prompt).logits, logits)
    infopt.undo(m)
    assert_state_equal(m, snap)
    assert torch.equal(m(prompt).logits, ref)


def test_bfloat16_model_trains_fp32_masters_and_converts_to_bf16_layers(prompt):
    m = tiny_model("llama", dtype=torch.bfloat16)
    prepare_qat_(m, small())
    layer = m.model.layers[0].mlp.up_proj
    assert layer.weight.dtype == torch.float32 and m(prompt).logits.dtype == torch.bfloat16
    convert_qat_(m)
    assert m.model.layers[0].mlp.up_proj.out_dtype == torch.bfloat16
    assert m(prompt).logits.dtype == torch.bfloat16


def test_quantize_verb_and_include():
    m = quantize_(tiny_model(), small(steps=2), calibration=calib(), include=["*.mlp.*"])
    assert isinstance(m.model.layers[0].mlp.up_proj, Int4Linear)
    assert type(m.model.layers[0].self_attn.q_proj) is nn.Linear
    assert QAT in CALIBRATED


# -- config and errors ------------------------------------------------------------------------------------
def test_config_round_trips():
    cfg = QAT(bits=8, group_size=-1, steps=50, lr=1e-5, loss="next_token", seed=3)
    d = cfg.to_dict()
    assert d["quantize"]["method"] == "qat"
    assert StepConfig.from_dict(d) == cfg
    r = Recipe.parse([{"quantize": {"method": "qat", "group_size": 64, "lr": 3e-5}}])
    assert r.steps == (QAT(group_size=64, lr=3e-5),)
    assert Recipe.from_yaml(r.to_yaml()) == r


@pytest.mark.parametrize("field,value", [("bits", 2), ("group_size", 48), ("group_size", -1), ("zero_point", "half"),
                                         ("steps", 0), ("lr", 0), ("lr", "1e-5"), ("lr", float("nan")),
                                         ("batch_size", True), ("samples", 0), ("seq_len", -1),
                                         ("max_grad_norm", 0), ("loss", "mse"), ("seed", 1.5), ("symmetric", "no")])
def test_bad_fields(field, value):
    with pytest.raises(RecipeError, match=f"QAT.{field}=.*allowed"):
        QAT(**{field: value})


def test_refusals_leave_the_model_untouched():
    m = tiny_model("llama")
    snap, before = state_snapshot(m), flags(m)
    with pytest.raises(IncompatibleModelError, match=r"in_features=64; use group_size 64 or 32"):
        prepare_qat_(m, QAT(group_size=128))
    with pytest.raises(IncompatibleModelError, match="use group_size 64 or 32"):
        infopt.optimize(m, [QAT(group_size=128)], calibration=calib())
    with pytest.raises(RecipeError, match="takes a quantize.QAT config"):
        prepare_qat_(m, Int4WeightOnly(group_size=32))
    with pytest.raises(RecipeError, match="no QATLinear"):
        convert_qat_(m)
    with pytest.raises(IncompatibleModelError, match="inference_mode"), torch.inference_mode():
        prepare_qat_(m, small())
    assert_state_equal(m, snap)
    assert flags(m) == before and not has_patches(m)
    prepare_qat_(m, small())
    with pytest.raises(IncompatibleModelError, match="already prepared"):
        prepare_qat_(m, small())


def test_meta_device_model_refused():
    with torch.device("meta"):
        m = tiny_model("llama")
    with pytest.raises(IncompatibleModelError, match="meta device.*Nothing was changed"):
        prepare_qat_(m, small())
    with pytest.raises(IncompatibleModelError, match="meta device"):
        quantize_(m, small(), calibration=calib())
    assert not has_patches(m) and not qat_layers(m)


def test_failure_during_training_leaves_the_model_untouched(monkeypatch, prompt):
    import infopt.quantize.algorithms.qat as qat

    m = tiny_model("llama")
    ref = m(prompt).logits
    snap, before = state_snapshot(m), flags(m)

    def boom(*args, **kwargs):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(qat, "finetune", boom)
    with pytest.raises(RuntimeError, match="interrupted"):
        infopt.optimize(m, [small()], calibration=calib())
    assert not has_patches(m) and "infopt" not in m.__dict__
    assert_state_equal(m, snap)
    assert flags(m) == before
    assert torch.equal(m(prompt).logits, ref)
