"""A long prompt's MLPs run on slices of tokens on a CPU (``generate.forward.mlps_in_slices``): the same logits bit for
bit, the MLP instances left as they were, and no slicing where it does not apply."""

from __future__ import annotations

import pytest
import torch

from infopt.generate import Forward
from infopt.generate import forward as fwd
from infopt.models import tiny_model
from infopt.quantize import Int4WeightOnly, quantize_


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("quant", [None, "int4-a8", "int4"])
def test_sliced_mlps_give_the_same_logits_and_leave_the_model_as_it_was(arch, quant, device, monkeypatch):
    m = tiny_model(arch).to(device)
    if quant:
        quantize_(m, Int4WeightOnly(group_size=32, activations="int8" if quant == "int4-a8" else "float"))
    calls = []
    mlp = m.model.layers[0].mlp
    original = type(mlp).forward
    monkeypatch.setattr(type(mlp), "forward", lambda self, x: calls.append(x.shape[-2]) or original(self, x))
    ids = torch.randint(0, 1000, (2, 70), device=device)
    with torch.no_grad():
        whole = m(ids).logits
        n = len(calls)
        # slices of 32 tokens x 2 rows: 64 rows, where the a8 layout's prompt path starts, as for the whole call
        with fwd.mlps_in_slices(m, ids.shape[-1], rows=32):
            sliced = m(ids).logits
    assert torch.equal(sliced, whole)
    layers = m.config.num_hidden_layers
    if device == "cpu":  # 70 tokens in slices of 32: 32, then the last 38 (no slice shorter than 32)
        assert calls[n:] == [32, 38] * layers
    else:  # on a GPU the MLPs take the whole prompt
        assert calls[n:] == [70] * layers
    assert all("forward" not in layer.mlp.__dict__ for layer in m.model.layers)


def test_forward_prefill_slices_long_prompts_only(monkeypatch):
    m = tiny_model("llama")
    seen = []
    mlp = m.model.layers[0].mlp
    original = type(mlp).forward
    monkeypatch.setattr(type(mlp), "forward", lambda self, x: seen.append(x.shape[-2]) or original(self, x))
    from transformers import DynamicCache

    f = Forward(m)
    for length in (8, 20):
        ids = torch.randint(0, 1000, (1, length))
        with torch.no_grad():
            monkeypatch.setattr(fwd, "MLP_ROWS", 10**6)
            want = f.prefill(ids, torch.arange(length)[None], None, DynamicCache(config=m.config))
            monkeypatch.setattr(fwd, "MLP_ROWS", 8)
            seen.clear()
            got = f.prefill(ids, torch.arange(length)[None], None, DynamicCache(config=m.config))
        assert torch.equal(got, want)
        assert seen == ([8] if length == 8 else [8, 12]) * m.config.num_hidden_layers  # the last slice 8-15


def test_an_instance_forward_set_before_is_restored():
    m = tiny_model("llama")
    mlp = m.model.layers[0].mlp
    own = mlp.forward  # an instance attribute, as a wrapper installed by someone else would be
    mlp.forward = own
    with torch.no_grad(), fwd.mlps_in_slices(m, 40, rows=16):
        assert mlp.forward is not own
        m(torch.randint(0, 1000, (1, 40)))
    assert mlp.__dict__["forward"] is own


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_mixture_of_experts_layers_are_not_sliced(arch):
    """Expert layers route tokens together (capacity, load balancing): left whole."""
    m = tiny_model(arch)
    assert fwd._token_wise_mlps(m) == ()
    with fwd.mlps_in_slices(m, 40, rows=16):
        assert all("forward" not in layer.mlp.__dict__ for layer in m.model.layers)
