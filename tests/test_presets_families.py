"""Every preset on every dense tiny family: it applies, generates (batch 1, and a left-padded batch 2), lossless
presets give plain generate's greedy tokens, lossy ones give the tokens of their weight quantization alone, and
undo restores the parameters bit for bit. gpu-fast is refused on CPU with the presets that do apply named.

The presets are read from :data:`infopt.recipe.PRESETS` as they stand, so a preset that gains or loses a step is
tested as it is. MoE families are covered beside the MoE code (tests/core/test_moe.py and friends).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import infopt
from infopt.compile import compile_stats
from infopt.core.errors import IncompatibleModelError
from infopt.core.patch import has_patches
from infopt.generate import routing_stats
from infopt.models import MOE_ARCHS, TINY_ARCHS, tiny_model
from infopt.recipe import PRESETS, Recipe

from .conftest import assert_state_equal, state_snapshot

DENSE = tuple(a for a in TINY_ARCHS if a not in MOE_ARCHS)
CUDA_ONLY = ("gpu-fast",)
CPU_PRESETS = tuple(p for p in PRESETS if p not in CUDA_ONLY)

# Inductor compiles each decode graph in tens of seconds on a 2-core CPU, and a preset's warm-up and a padded batch
# compile several. So a preset's compile step runs on the real inductor backend for two families chosen to differ
# most: gemma3 (sliding-window layers, one KV head, q/k norms, a scaled embedding: what once made the decode step
# recompile every token) and gpt2 (learned positions, a fused Conv1D qkv, plain multi-head attention). The other
# families run the same recipe with the compile step on "aot_eager": dynamo traces and guards the same graphs
# (fullgraph, recompiles, the eager fallback all behave as with inductor); only inductor's code generation is
# skipped, and test_compile.py covers that on llama.
INDUCTOR_FAMILIES = ("gemma3", "gpt2")
NEW = 16
PROMPT = torch.tensor([[1, 17, 400, 23, 9, 1200, 5]])
BATCH = torch.tensor([[2, 2, 1, 17, 400, 23, 9], [1, 30, 40, 50, 60, 70, 80]])  # row 0 left-padded
BATCH_MASK = (BATCH != 2).long()
CALLS = ({"input_ids": PROMPT}, {"input_ids": BATCH, "attention_mask": BATCH_MASK})
GREEDY = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=2)
TIE = 1e-2
"""Logit gap under which two tokens are a tie (tiny random models' logits are flat: gaps of 1e-3 occur), where a
lossy preset's compiled step may pick the other token than the same quantization run eagerly: int8 activations
round a slightly different activation (inductor sums in another order) to another code."""


def _model(arch: str):
    # gemma3 as the real family is built: one KV head shared by every query head
    return tiny_model(arch, num_kv_heads=1) if arch == "gemma3" else tiny_model(arch)


def _steps(preset: str, compile_backend: str | None = None) -> list:
    """The preset's steps, its compile step (if any) on ``compile_backend`` (None: as the preset has it)."""
    steps = Recipe.parse(preset).steps
    if compile_backend is None:
        return list(steps)
    return [dataclasses.replace(s, backend=compile_backend) if s.stage == "compile" else s for s in steps]


def _lossy(preset: str) -> bool:
    # compile is not marked lossless (fused kernels may reorder sums) but keeps greedy tokens on these models
    return any(not s.lossless and s.stage != "compile" for s in Recipe.parse(preset).steps)


def _generate(model) -> list[torch.Tensor]:
    return [model.generate(**call, **GREEDY) for call in CALLS]


@functools.cache
def _plain(arch: str) -> tuple[torch.Tensor, ...]:
    """Plain generate's greedy tokens for :data:`CALLS` (computed once per family)."""
    return tuple(_generate(_model(arch)))


def _assert_same_up_to_a_tie(out: torch.Tensor, expected: torch.Tensor, call: dict, model) -> None:
    """``out`` is ``expected`` token for token, or first differs where ``model`` (which produced ``expected``) has
    the two tokens within :data:`TIE` of each other; past that point the continuations are free to differ."""
    for r in range(out.shape[0]):
        diff = (out[r] != expected[r]).nonzero()
        if not len(diff):
            continue
        c = int(diff[0])
        mask = call.get("attention_mask", torch.ones_like(call["input_ids"]))[r:r + 1]
        mask = torch.cat([mask, mask.new_ones(1, c - mask.shape[1])], dim=1)  # [1, c]
        with torch.no_grad():
            logits = model(expected[r:r + 1, :c], attention_mask=mask,
                           position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[0, -1]
        gap = float(logits[expected[r, c]] - logits[out[r, c]])
        assert 0 <= gap < TIE, f"row {r} differs at {c} where the logits are {gap:.2e} apart (no tie)"


def _check(preset: str, arch: str, compile_backend: str | None) -> None:
    m = _model(arch)
    snap = state_snapshot(m)
    plain = _plain(arch)
    infopt.optimize(m, preset if compile_backend is None else _steps(preset, compile_backend))
    out = _generate(m)
    for o, p in zip(out, plain, strict=True):
        assert o.shape == p.shape == (p.shape[0], PROMPT.shape[1] + NEW)
    if _lossy(preset):
        # the same weight quantization alone, on plain generate: the rest of the stack (static cache, compiled step;
        # a quantized KV cache, exact while prompt + new tokens stay in its residual window) changes no token but
        # at a tie
        alone = _model(arch)
        infopt.optimize(alone, [s for s in Recipe.parse(preset).steps if s.stage == "quantize"])
        for o, call in zip(out, CALLS, strict=True):
            _assert_same_up_to_a_tie(o, alone.generate(**call, **GREEDY), call, alone)
    else:
        for o, p in zip(out, plain, strict=True):
            assert torch.equal(o, p)  # lossless: plain generate's tokens exactly
    stats = routing_stats(m)
    assert stats.original == 0, stats.reasons  # every call served by infopt, none handed back to plain generate
    cs = compile_stats(m)
    if cs is not None:
        assert not cs.eager_shapes, cs.eager_shapes  # every compiled shape held its graph
    infopt.undo(m)
    assert_state_equal(m, snap)
    assert not has_patches(m) and "generate" not in m.__dict__
    assert torch.equal(m.generate(**CALLS[0], **GREEDY), plain[0])


@pytest.mark.slow
@pytest.mark.parametrize("preset", CPU_PRESETS)
@pytest.mark.parametrize("arch", [a for a in DENSE if a not in INDUCTOR_FAMILIES])
def test_preset_on_family(arch, preset):
    _check(preset, arch, compile_backend="aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("preset", CPU_PRESETS)
@pytest.mark.parametrize("arch", INDUCTOR_FAMILIES)
def test_preset_on_family_inductor(arch, preset):
    """The presets exactly as a user applies them (by name), compiled by inductor."""
    _check(preset, arch, compile_backend=None)


@pytest.mark.parametrize("preset", CUDA_ONLY)
@pytest.mark.parametrize("arch", DENSE)
def test_cuda_preset_refused_on_cpu_model_untouched(arch, preset):
    m = _model(arch)
    snap = state_snapshot(m)
    with pytest.raises(IncompatibleModelError, match=rf"preset '{preset}' does not apply to this model \(cpu\)") as e:
        infopt.optimize(m, preset)
    assert "CUDA" in str(e.value) and "cpu-fast" in str(e.value)  # why, and what to use instead
    assert_state_equal(m, snap)
    assert not has_patches(m) and "generate" not in m.__dict__ and "infopt" not in m.__dict__


@pytest.mark.gpu
@pytest.mark.parametrize("preset", CUDA_ONLY)
@pytest.mark.parametrize("arch", DENSE)
def test_cuda_preset_on_family(arch, preset):
    ref, m = _model(arch).cuda(), _model(arch).cuda()
    infopt.optimize(m, preset)
    for call in CALLS:
        call = {k: v.cuda() for k, v in call.items()}
        assert torch.equal(m.generate(**call, **GREEDY), ref.generate(**call, **GREEDY))
    assert routing_stats(m).original == 0
