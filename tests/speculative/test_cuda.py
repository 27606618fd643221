"""Speculative decoding on CUDA: greedy output token-identical to plain generate on the same GPU, with the
speculative loop (not a fallback) serving every call and accepting drafted tokens."""

import pytest
import torch

import infopt
from infopt.generate import routing_stats
from infopt.models import tiny_model
from infopt.speculative import DraftModel, PromptLookup, SelfDraft, enable_, stats

from .test_exact import prompts

pytestmark = pytest.mark.gpu

# fp32 models: bf16 logits tie often enough on a random tiny model that the verify forward (k + 1 tokens at once)
# and plain decoding (one token) could pick different argmaxes, which would say nothing about the loop


def _config(kind, tmp_path):
    if kind == "lookup":
        return PromptLookup(num_tokens=4)
    if kind == "draft-model":
        return DraftModel(tiny_model(num_layers=1, seed=1).cuda(), num_tokens=3)
    if kind == "draft-folder":  # loaded by enable_ onto the target's device
        tiny_model(num_layers=1, seed=1).save_pretrained(tmp_path / "draft")
        return DraftModel(str(tmp_path / "draft"), num_tokens=3)
    if kind == "self-int4":
        return SelfDraft(quantize="int4", num_tokens=3)
    if kind == "self-layers":
        return SelfDraft(quantize=None, num_layers=1, num_tokens="adaptive")
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["lookup", "draft-model", "draft-folder", "self-int4", "self-layers"])
def test_greedy_identical_on_cuda(kind, tmp_path):
    ref, m = tiny_model().cuda(), tiny_model().cuda()
    enable_(m, _config(kind, tmp_path))
    for p in prompts(10):
        p = p.cuda()
        want = ref.generate(p, max_new_tokens=24, do_sample=False)
        got = m.generate(p, max_new_tokens=24, do_sample=False)
        assert got.is_cuda and torch.equal(got, want), (p, got, want)
    assert routing_stats(m).infopt == 10 and routing_stats(m).original == 0
    s = stats(m)
    assert s["calls"] == 10 and s["tokens"] == 10 * 24
    assert s["drafted"] > 0 and s["accepted"] > 0
    assert s["target_forwards_per_token"] < 1  # some rounds kept drafted tokens: fewer target forwards than tokens


def test_self_draft_int4_layers_use_the_cuda_kernel(monkeypatch):
    from infopt.quantize import Int4Linear
    from infopt.speculative import build_self_draft

    m = tiny_model().cuda()
    draft, _ = build_self_draft(m, SelfDraft(quantize="int4"))
    layers = [mod for mod in draft.modules() if isinstance(mod, Int4Linear)]
    assert layers and {mod.layout for mod in layers} == {"cuda_tinygemm"}
    calls = []
    real = torch._weight_int4pack_mm

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_weight_int4pack_mm", counting)
    with torch.no_grad():
        draft(torch.tensor([[1, 17, 400, 23]], device="cuda"))
    assert len(calls) == len(layers)


def test_static_cache_composes_on_cuda():
    from infopt.kvcache import Static

    ref, m = tiny_model().cuda(), tiny_model().cuda()
    infopt.optimize(m, [Static(max_length=256), PromptLookup(num_tokens=4)])
    for p in prompts(5):
        p = p.cuda()
        assert torch.equal(m.generate(p, max_new_tokens=20, do_sample=False),
                           ref.generate(p, max_new_tokens=20, do_sample=False))
    assert routing_stats(m).infopt == 5 and stats(m)["drafted"] > 0
    assert "static cache" in " ".join(m.infopt.steps[-1].notes)
