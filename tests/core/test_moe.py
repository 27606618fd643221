import pytest
import transformers as tf

from infopt.core.errors import IncompatibleModelError
from infopt.core.introspect import inspect_model
from infopt.core.moe import is_experts_module, is_moe, moe_blocks, moe_param_counts, require_dense
from infopt.models import MOE_ARCHS, tiny_model


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_blocks_found_in_every_moe_family(arch):
    m = tiny_model(arch, num_layers=3)
    blocks = moe_blocks(m)
    assert [b.layer for b in blocks] == [0, 1, 2]
    for b in blocks:
        assert b.standard and b.reason == ""
        assert b.block_fqn == f"model.layers.{b.layer}.mlp" and b.experts_fqn == b.block_fqn + ".experts"
        assert m.get_submodule(b.router_fqn).weight.shape == (4, 64)
        assert (b.num_experts, b.top_k, b.hidden_size) == (4, 2, 64)
        assert m.get_submodule(b.experts_fqn).down_proj.shape == (4, 64, b.intermediate_size)
        shared = arch == "qwen2_moe"
        assert b.shared_fqns == ((b.block_fqn + ".shared_expert",) if shared else ())
        assert b.shared_gate_fqn == (b.block_fqn + ".shared_expert_gate" if shared else None)
    info = inspect_model(m)  # attention as Llama; Qwen2-MoE's shared experts are ordinary linears
    assert len(info.attn_linear_fqns) == 12
    assert len(info.mlp_linear_fqns) == (9 if arch == "qwen2_moe" else 0)
    assert is_moe(m)


def test_dense_models_have_no_blocks():
    m = tiny_model("llama")
    assert moe_blocks(m) == () and not is_moe(m)
    require_dense(m, "a step", "a reason")  # passes
    assert not is_experts_module(m.model.layers[0].mlp)


def test_mixed_dense_and_sparse_layers():
    # Qwen2-MoE keeps the layers in mlp_only_layers dense: only the others are blocks
    config = tf.Qwen2MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32, shared_expert_intermediate_size=64, mlp_only_layers=[1])
    m = tf.AutoModelForCausalLM.from_config(config)
    assert [b.layer for b in moe_blocks(m)] == [0, 2]
    assert "model.layers.1.mlp.up_proj" in inspect_model(m).mlp_linear_fqns


def test_nonstandard_experts_flagged():
    m = tiny_model("mixtral")
    m.model.layers[1].mlp.experts.is_transposed = True
    blocks = moe_blocks(m)
    assert blocks[0].standard and not blocks[1].standard and "is_transposed" in blocks[1].reason


def test_require_dense_names_step_and_reason():
    with pytest.raises(IncompatibleModelError, match=r"my_step does not support mixture-of-experts.*mlp\.experts.*"
                                                     r"4 experts\): it splits MLPs\. Use other instead"):
        require_dense(tiny_model("olmoe"), "my_step", "it splits MLPs", instead="other")


def test_tensor_parallel_refuses_moe():
    from infopt.parallel.tensor import plan_tensor_parallel

    with pytest.raises(IncompatibleModelError, match="tensor parallelism does not support mixture-of-experts"):
        plan_tensor_parallel(tiny_model("mixtral"), 2)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_param_counts_match_built_model(arch):
    m = tiny_model(arch)
    c = moe_param_counts(m)
    total = sum(p.numel() for p in m.parameters())  # parameters() yields tied weights once
    experts = sum(m.get_submodule(b.experts_fqn).gate_up_proj.numel() + m.get_submodule(b.experts_fqn).down_proj.numel()
                  for b in moe_blocks(m))
    assert c["total"] == total and c["experts"] == experts
    assert c["active"] == total - experts // 2  # 2 of 4 experts per token
    # quantized experts count their logical weights, so the figures do not change
    from infopt.quantize import Int8WeightOnly, quantize_

    quantize_(m, Int8WeightOnly(), include=["*.experts"])
    assert moe_param_counts(m) == c

