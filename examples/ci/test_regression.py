"""A sample CI regression test for an optimized model, using the infopt pytest plugin (infopt.testing).

Copy into your project's tests/ and record the goldens once, on a trusted build:

    pytest tests/test_regression.py --infopt-update-golden     # writes tests/golden/*.safetensors + *.json
    git add tests/golden

Every later run (CI) compares against them:

    pytest tests/test_regression.py                 # CPU, plus each visible CUDA device
    pytest tests/test_regression.py -m gpu          # the CUDA cases only (GPU runner)

It uses a tiny random model so it runs in seconds; swap in your own model (and a tokenizer, for text
prompts and decoded diffs).
"""

import pytest
import torch

import infopt
from infopt.models import tiny_model
from infopt.testing import assert_generates_same, assert_quality

PROMPTS = [[1, 17, 400, 23, 9], torch.tensor([5, 1200, 7, 31])]  # token ids: no tokenizer needed
EVAL_IDS = torch.arange(1, 129) * 389 % 49_000  # [128] ids for the quality check


def _model(device: str):
    return tiny_model("llama").to(device)


def test_lossless_recipe_keeps_tokens(infopt_device, infopt_golden):
    """Lossless steps (attention backend, static KV cache) must reproduce the baseline's greedy tokens exactly."""
    model = _model(infopt_device)
    infopt.optimize(model, [infopt.attention.Attention("sdpa"), infopt.kvcache.Static(max_length=128)])
    assert_generates_same(model, None, PROMPTS, infopt_golden, max_new_tokens=16,
                          reference=_model(infopt_device))


@pytest.mark.parametrize("max_kl, min_top1", [(0.05, 0.9)], ids=["int8-gate"])
def test_int8_quality(infopt_device, infopt_golden, max_kl, min_top1):
    """A lossy step is gated on KL / top-1 agreement against the recorded fp32 baseline."""
    model = _model(infopt_device)
    infopt.optimize(model, [infopt.quantize.Int8WeightOnly()])
    figs = assert_quality(model, infopt_golden, input_ids=EVAL_IDS, reference=_model(infopt_device),
                          max_kl=max_kl, min_top1=min_top1)
    print(f"int8 on {infopt_device}: KL {figs['kl']:.3g}, top-1 {figs['top1']:.3f}")


@pytest.mark.gpu
def test_cuda_bf16_generation(infopt_golden):
    """Runs only where CUDA is visible (skipped with a reason on CPU runners)."""
    model = tiny_model("llama", dtype=torch.bfloat16).to("cuda")
    assert_generates_same(model, None, PROMPTS, infopt_golden, max_new_tokens=16)
