"""``Attention(backend="sdpa_gqa", prompt_dtype="bfloat16")``: an fp32 model's long prompts attend in bf16 on a CPU
with native bf16 (the kernel given bf16 operands, the output back in fp32); shorter calls, decode steps and every
other case attend as before, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import infopt
from infopt.attention import Attention, backends
from infopt.attention.gqa import PROMPT_DTYPE_ATTR, PROMPT_MIN_ROWS, gqa_sdpa_forward
from infopt.core.errors import RecipeError
from infopt.generate import Forward
from infopt.kvcache.static import full_length_static_cache
from infopt.models import tiny_model


def _layer(groups: int) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.num_key_value_groups, layer.is_causal = groups, True
    setattr(layer, PROMPT_DTYPE_ATTR, torch.bfloat16)
    return layer


@pytest.mark.parametrize("groups", [2, 1], ids=["grouped", "one-kv-head-per-query"])
@pytest.mark.parametrize("rows", [PROMPT_MIN_ROWS - 1, PROMPT_MIN_ROWS, 150])
@pytest.mark.parametrize("case", ["causal", "padded", "fp16-cache"])
def test_long_prompts_attend_on_bf16_operands_and_short_ones_as_before(groups, rows, case):
    torch.manual_seed(rows + groups)
    q = torch.randn(2, 4, rows, 16)
    k, v = torch.randn(2, 4 // groups, rows, 16), torch.randn(2, 4 // groups, rows, 16)
    mask = None
    if case == "padded":  # a boolean mask, as transformers builds it for SDPA: row 1 left-padded by 5
        mask = torch.ones(rows, rows, dtype=torch.bool).tril().expand(2, 1, rows, rows).clone()
        mask[1, :, :, :5] = False
        mask[1, :, :5, :5] = torch.eye(5, dtype=torch.bool)  # padded queries attend to themselves (no empty row)
    if case == "fp16-cache":  # kvcache.Static(dtype="float16") hands its keys and values over in fp16
        k, v = k.half(), v.half()
    out, _ = gqa_sdpa_forward(_layer(groups), q, k, v, mask)
    long = rows >= PROMPT_MIN_ROWS
    dt = torch.bfloat16 if long else torch.float32
    want = F.scaled_dot_product_attention(q.to(dt), k.to(dt), v.to(dt), attn_mask=mask, is_causal=mask is None,
                                          enable_gqa=True)
    assert out.dtype == torch.float32 and out.is_contiguous() and out.shape == (2, rows, 4, 16)
    assert torch.equal(out, want.transpose(1, 2).float())


def _models():
    torch.manual_seed(0)
    plain, low = tiny_model("llama"), tiny_model("llama")
    low.load_state_dict(plain.state_dict())
    infopt.optimize(plain, [Attention("sdpa_gqa")])
    return plain, low


def test_a_model_attends_in_bf16_on_long_prompts_only(monkeypatch):
    monkeypatch.setattr(backends, "fast_bf16_gemm", lambda: True)  # whatever this CPU has
    plain, low = _models()
    infopt.optimize(low, [Attention("sdpa_gqa", prompt_dtype="bfloat16")])
    assert any("prompts of 64+ tokens attend in bfloat16" in n for n in low.infopt.steps[0].notes)
    with torch.no_grad():
        for rows in (8, 100):
            ids = torch.randint(3, 1000, (1, rows))
            caches = [full_length_static_cache(m.config, 256) for m in (plain, low)]
            a, b = (Forward(m).prefill(ids, torch.arange(rows)[None], None, c)
                    for m, c in zip((plain, low), caches, strict=True))
            if rows < PROMPT_MIN_ROWS:
                assert torch.equal(a, b)
            else:  # bf16 operands: close, not equal
                assert not torch.equal(a, b)
                torch.testing.assert_close(b, a, rtol=0.05, atol=0.05)
            # the next token's step (one query row) attends in fp32 in both, over the caches the prompts filled
            step = [Forward(m).step(ids[:, -1:], torch.tensor([[rows]]), torch.tensor([rows]), None, c)
                    for m, c in zip((plain, low), caches, strict=True)]
            if rows < PROMPT_MIN_ROWS:
                assert torch.equal(step[0], step[1])
            else:  # over caches that bf16 prompts filled a little differently
                torch.testing.assert_close(step[1], step[0], rtol=0.05, atol=0.05)
    infopt.undo(low)
    assert all(PROMPT_DTYPE_ATTR not in layer.self_attn.__dict__ for layer in low.model.layers)


@pytest.mark.parametrize("why", ["no-native-bf16", "bf16-model"])
def test_where_it_would_not_pay_nothing_changes_and_the_report_says_why(monkeypatch, why):
    monkeypatch.setattr(backends, "fast_bf16_gemm", lambda: why != "no-native-bf16")
    m = tiny_model("llama")
    if why == "bf16-model":
        m = m.to(torch.bfloat16)
    infopt.optimize(m, [Attention("sdpa_gqa", prompt_dtype="bfloat16")])
    notes = " ".join(m.infopt.steps[0].notes)
    assert "prompt_dtype bfloat16 not applied" in notes
    assert ("no native bf16" if why == "no-native-bf16" else "computes in torch.bfloat16") in notes
    assert all(PROMPT_DTYPE_ATTR not in layer.self_attn.__dict__ for layer in m.model.layers)


def test_the_field_is_checked_and_makes_the_step_lossy():
    step = Attention("sdpa_gqa", prompt_dtype="bfloat16")
    assert step.fidelity == "lossy" and Attention("sdpa_gqa").fidelity == "lossless"
    assert step.to_dict() == {"attention": {"backend": "sdpa_gqa", "prompt_dtype": "bfloat16"}}
    with pytest.raises(RecipeError, match="only backend 'sdpa_gqa' reads a prompt dtype"):
        Attention("sdpa", prompt_dtype="bfloat16")
    with pytest.raises(RecipeError, match="allowed: bfloat16, or null"):
        Attention("sdpa_gqa", prompt_dtype="float16")
    assert infopt.PRESETS["cpu-fast"].steps[0] == {"attention": {"backend": "sdpa_gqa", "prompt_dtype": "bfloat16"}}
