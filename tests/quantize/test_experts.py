"""Weight-only int8/int4 of mixture-of-experts experts (infopt.quantize.experts)."""

import pytest
import torch

import infopt
from infopt.core.errors import IncompatibleModelError, RecipeError
from infopt.core.moe import moe_blocks
from infopt.eval.metrics import logit_metrics
from infopt.io import load_optimized, save_optimized
from infopt.models import tiny_model
from infopt.quantize import Int4Linear, Int4WeightOnly, Int8Linear, Int8WeightOnly, quantize_
from infopt.quantize.experts import QuantizedExperts

from ..conftest import assert_state_equal, state_snapshot

IDS = torch.randint(3, 49000, (1, 64), generator=torch.Generator().manual_seed(0))


def _routes(model, ids):
    """Per MoE block: (router probabilities [T, E], top-k indices [T, k]) for one forward of ``ids``."""
    got = []
    hooks = [model.get_submodule(b.router_fqn).register_forward_hook(
        lambda mod, args, out: got.append((out[0].float().softmax(-1), out[2].sort(-1).values)))
        for b in moe_blocks(model)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return got


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_int4_experts_quality_and_undo(arch):
    m = tiny_model(arch)
    with torch.no_grad():
        ref = m(IDS).logits
    snap = state_snapshot(m)
    router_w = m.model.layers[0].mlp.gate.weight
    infopt.optimize(m, [Int4WeightOnly(group_size=32)])
    experts = m.model.layers[0].mlp.experts
    assert isinstance(experts, QuantizedExperts) and experts.num_experts == 4
    assert all(isinstance(layer, Int4Linear) for layer in (*experts.gate_up_proj, *experts.down_proj))
    assert m.model.layers[0].mlp.gate.weight is router_w and router_w.dtype == torch.float32  # router untouched
    with torch.no_grad():
        out = m(IDS).logits
    stats = logit_metrics(out, ref, IDS)
    assert stats["kl"] < 0.05, stats  # the dense int4 bound (tests/quantize/test_int4.py)
    assert stats["top1"] >= 0.7, stats  # measured 0.88 (mixtral), 0.77 (qwen2_moe) on these random tiny models
    assert m.infopt.steps[0].stats["experts_quantized"] == 2
    infopt.undo(m)
    assert_state_equal(m, snap)
    with torch.no_grad():
        assert torch.equal(m(IDS).logits, ref)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_int8_fp32_keeps_routing_outside_near_ties(arch):
    m = tiny_model(arch, num_layers=3)
    before = _routes(m, IDS)
    quantize_(m, Int8WeightOnly(compute_dtype="float32"))
    after = _routes(m, IDS)
    k = m.config.num_experts_per_tok
    for (p, idx), (_, idx_q) in zip(before, after, strict=True):
        top = p.topk(k + 1, dim=-1).values
        clear = (top[:, k - 1] - top[:, k]) > 1e-3  # the k-th expert beats the next by more than int8 noise
        assert clear.float().mean() > 0.8
        assert torch.equal(idx[clear], idx_q[clear])


def test_experts_only_keeps_first_router_input_bit_exact():
    m = tiny_model("mixtral")
    before = _routes(m, IDS)
    quantize_(m, Int8WeightOnly(), include=["*.mlp.experts"])
    assert isinstance(m.model.layers[0].self_attn.q_proj, torch.nn.Linear)  # only the experts were swapped
    after = _routes(m, IDS)
    assert torch.equal(before[0][0], after[0][0]) and torch.equal(before[0][1], after[0][1])


@pytest.mark.parametrize("make", [lambda w: Int8Linear.from_float(w, compute_dtype="float32"),
                                  lambda w: Int4Linear.from_float(w, group_size=32, layout="plain")],
                         ids=["int8", "int4"])
def test_forward_matches_float_experts_on_dequantized_weights(make):
    experts = tiny_model("olmoe").model.layers[0].mlp.experts
    q = QuantizedExperts.from_experts(experts, make)
    gate_up, down = q.dequantize()
    assert gate_up.shape == experts.gate_up_proj.shape and down.shape == experts.down_proj.shape
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
    x = torch.randn(10, 64)
    idx = torch.stack([torch.randperm(4)[:2] for _ in range(10)])
    w = torch.rand(10, 2)
    with torch.no_grad():
        torch.testing.assert_close(q(x, idx, w), experts(x, idx, w), rtol=1e-4, atol=1e-5)


def test_experts_false_and_exclude_leave_experts_float():
    m = tiny_model("qwen3_moe")
    quantize_(m, Int8WeightOnly(experts=False))
    assert not isinstance(m.model.layers[0].mlp.experts, QuantizedExperts)
    m = tiny_model("qwen3_moe")
    quantize_(m, Int4WeightOnly(group_size=32), exclude=["model.layers.1.mlp.experts"])
    assert isinstance(m.model.layers[0].mlp.experts, QuantizedExperts)
    assert not isinstance(m.model.layers[1].mlp.experts, QuantizedExperts)


def test_bad_experts_field_and_nonstandard_experts_refused():
    with pytest.raises(RecipeError, match="experts"):
        Int4WeightOnly(experts="yes")
    m = tiny_model("mixtral")
    m.model.layers[0].mlp.experts.has_bias = True  # a layout infopt does not replace
    snap = state_snapshot(m)
    with pytest.raises(IncompatibleModelError, match="has_bias.*experts=False"):
        infopt.optimize(m, [Int8WeightOnly()])
    assert_state_equal(m, snap)


def test_group_size_not_dividing_expert_width_refused():
    import transformers as tf

    config = tf.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    m = tf.AutoModelForCausalLM.from_config(config).eval()  # experts 64 -> 192 -> 96 -> 64
    with pytest.raises(IncompatibleModelError, match="down_proj's input width 96"):
        infopt.optimize(m, [Int4WeightOnly(group_size=64)])
    infopt.optimize(m, [Int4WeightOnly(group_size=32)])
    assert isinstance(m.model.layers[0].mlp.experts, QuantizedExperts)


@pytest.mark.parametrize("config", [Int4WeightOnly(group_size=32), Int8WeightOnly()], ids=["int4", "int8"])
def test_save_reload_identical(tmp_path, config):
    m = tiny_model("qwen2_moe")
    infopt.optimize(m, [config])
    with torch.no_grad():
        logits = m(IDS).logits
    save_optimized(m, tmp_path / "q")
    m2, _ = load_optimized(tmp_path / "q")
    assert isinstance(m2.model.layers[1].mlp.experts, QuantizedExperts)
    with torch.no_grad():
        assert torch.equal(m2(IDS).logits, logits)


def test_save_pretrained_refuses_quantized_experts(tmp_path):
    from infopt.core.errors import CheckpointError

    m = tiny_model("mixtral")
    infopt.optimize(m, [Int8WeightOnly()])
    with pytest.raises(CheckpointError, match="save_optimized"):
        m.save_pretrained(tmp_path / "hf")


def _routing(model, ids):
    """(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) as layer 0's experts receive them."""
    got = {}
    block = model.model.layers[0].mlp
    h = block.experts.register_forward_pre_hook(lambda mod, args: got.setdefault("args", args))
    with torch.no_grad():
        model(ids)
    h.remove()
    return got["args"]


def test_experts_op_runs_the_eager_dispatch_and_copies_get_their_own_handle():
    """Compiled graphs reach the experts through infopt::quantized_experts and an int handle: the op gives the
    module's own output, a deep copy names itself (not the module it was copied from), and a handle whose module
    is gone raises instead of running other weights."""
    import copy
    import gc

    m = tiny_model("mixtral")
    quantize_(m, Int4WeightOnly(group_size=32))
    x, idx, w = _routing(m, IDS)
    experts = m.model.layers[0].mlp.experts
    with torch.no_grad():
        want = experts(x, idx, w)
        assert torch.equal(torch.ops.infopt.quantized_experts(x, idx, w, experts._handle), want)
        clone = copy.deepcopy(experts)
        assert clone._handle != experts._handle
        clone.down_proj[0] = clone.down_proj[1]  # the copy's weights differ: its handle must reach them
        assert torch.equal(torch.ops.infopt.quantized_experts(x, idx, w, clone._handle), clone(x, idx, w))
        handle = clone._handle
        del clone
        gc.collect()
        with pytest.raises(RuntimeError, match="no longer exists"):
            torch.ops.infopt.quantized_experts(x, idx, w, handle)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_compiled_decode_step_holds_one_graph_token_identical(arch):
    """The per-expert loop has data-dependent shapes; under compile it is one opaque op, so the whole decode step is
    one graph (aot_eager: dynamo and AOTAutograd trace it with fake tensors, as inductor does) and decodes the same
    tokens as the quantized model without compile."""
    from infopt.compile import Compile, compile_stats
    from infopt.kvcache import Static

    ref, m = tiny_model(arch), tiny_model(arch)
    infopt.optimize(ref, [Int4WeightOnly(group_size=32)])
    infopt.optimize(m, [Int4WeightOnly(group_size=32), Static(max_length=256), Compile(backend="aot_eager")])
    ids = IDS[:, :12]
    assert torch.equal(m.generate(ids, max_new_tokens=16, do_sample=False),
                       ref.generate(ids, max_new_tokens=16, do_sample=False))
    stats = compile_stats(m)
    assert stats.compiles == 1 and not stats.eager_shapes and stats.eager_calls == 0 and stats.calls >= 15
