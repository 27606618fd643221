"""Speculative decoding on each device (``cpu``, and ``cuda`` under the gpu marker): greedy output token-identical
to plain generate on the same model, with the speculative loop (not a fallback) serving every call and accepting
drafted tokens."""

import pytest
import torch

import infopt
from infopt.generate import routing_stats
from infopt.models import tiny_model
from infopt.speculative import DraftModel, PromptLookup, SelfDraft, enable_, stats
from tests.devices import DEVICES, INT4_KERNELS, count_calls

from .test_exact import prompts

# fp32 models: bf16 logits tie often enough on a random tiny model that the verify forward (k + 1 tokens at once)
# and plain decoding (one token) could pick different argmaxes, which would say nothing about the loop


def _config(kind, tmp_path, device):
    if kind == "lookup":
        return PromptLookup(num_tokens=4)
    if kind == "draft-model":
        return DraftModel(tiny_model(num_layers=1, seed=1).to(device), num_tokens=3)
    if kind == "draft-folder":  # loaded by enable_ onto the target's device
        tiny_model(num_layers=1, seed=1).save_pretrained(tmp_path / "draft")
        return DraftModel(str(tmp_path / "draft"), num_tokens=3)
    if kind == "self-int4":
        return SelfDraft(quantize="int4", num_tokens=3)
    if kind == "self-layers":
        return SelfDraft(quantize=None, num_layers=1, num_tokens="adaptive")
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["lookup", "draft-model", "draft-folder", "self-int4", "self-layers"])
def test_greedy_identical(kind, tmp_path, device):
    ref, m = tiny_model().to(device), tiny_model().to(device)
    enable_(m, _config(kind, tmp_path, device))
    for p in prompts(10):
        p = p.to(device)
        want = ref.generate(p, max_new_tokens=24, do_sample=False)
        got = m.generate(p, max_new_tokens=24, do_sample=False)
        assert got.device.type == device and torch.equal(got, want), (p, got, want)
    assert routing_stats(m).infopt == 10 and routing_stats(m).original == 0
    s = stats(m)
    assert s["calls"] == 10 and s["tokens"] == 10 * 24
    assert s["drafted"] > 0 and s["accepted"] > 0
    assert s["target_forwards_per_token"] < 1  # some rounds kept drafted tokens: fewer target forwards than tokens


def test_self_draft_int4_layers_use_the_devices_kernel(monkeypatch, device):
    from infopt.quantize import Int4Linear
    from infopt.speculative import build_self_draft

    m = tiny_model().to(device)
    draft, _ = build_self_draft(m, SelfDraft(quantize="int4"))
    layers = [mod for mod in draft.modules() if isinstance(mod, Int4Linear)]
    layout = DEVICES[device].int4_auto_layout()
    assert layers and {mod.layout for mod in layers} == {layout}
    calls = count_calls(monkeypatch, *INT4_KERNELS[layout])
    with torch.no_grad():
        draft(torch.tensor([[1, 17, 400, 23]], device=device))
    assert len(calls) == len(layers)  # each layer, once, through its kernel: nothing dequantized on the side


def test_static_cache_composes(device):
    from infopt.kvcache import Static

    ref, m = tiny_model().to(device), tiny_model().to(device)
    infopt.optimize(m, [Static(max_length=256), PromptLookup(num_tokens=4)])
    for p in prompts(5):
        p = p.to(device)
        assert torch.equal(m.generate(p, max_new_tokens=20, do_sample=False),
                           ref.generate(p, max_new_tokens=20, do_sample=False))
    assert routing_stats(m).infopt == 5 and stats(m)["drafted"] > 0
    assert "static cache" in " ".join(m.infopt.steps[-1].notes)
