import pytest
import torch
from torch import nn

from infopt.core.errors import IncompatibleModelError
from infopt.core.introspect import SUPPORTED_MODEL_TYPES, inspect_model, param_bytes
from infopt.models import TINY_ARCHS, tiny_model


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_inspect_every_tiny_arch(arch):
    m = tiny_model(arch, num_layers=3)
    info = inspect_model(m)
    assert info.num_layers == 3
    assert len(info.layer_fqns) == 3
    for fqn in info.attn_linear_fqns + info.mlp_linear_fqns:
        mod = m.get_submodule(fqn)
        assert hasattr(mod, "weight")
    assert info.num_heads % info.num_kv_heads == 0
    assert info.head_dim * info.num_heads == 64 or arch in ("gemma", "gemma3", "qwen3")
    if arch == "gpt2":
        assert info.rope_theta is None and info.conv1d
    else:
        assert info.rope_theta and info.gqa_groups == 2


def test_unknown_architecture_lists_supported():
    from transformers import BertConfig, BertForMaskedLM

    m = BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
    with pytest.raises(IncompatibleModelError) as e:
        inspect_model(m)
    assert "bert" in str(e.value)
    for t in ("llama", "qwen2", "gpt2"):
        assert t in str(e.value)
    assert set(SUPPORTED_MODEL_TYPES) >= {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3_text", "phi3", "gpt2"}


def test_plain_module_refused():
    with pytest.raises(IncompatibleModelError, match="AutoModelForCausalLM"):
        inspect_model(nn.Linear(2, 2))


def test_param_bytes_counts_tied_once():
    m = tiny_model("llama")
    total = sum(p.numel() * 4 for p in m.parameters())  # parameters() already dedups tied
    buffers = sum(b.numel() * b.element_size() for b in m.buffers())
    assert param_bytes(m) == total + buffers
    assert param_bytes(m.to(torch.bfloat16)) < total
