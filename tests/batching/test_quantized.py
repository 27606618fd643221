"""Quantized weights through the engine: each request's greedy tokens are the quantized model's own ``generate``
tokens (the int8 kernels quantize activations per row, so a row's result does not depend on its batch)."""

from __future__ import annotations

import random

import pytest
import torch

import infopt
from infopt.batching import Engine, SamplingParams
from infopt.kvcache import Paged
from infopt.models import tiny_model
from infopt.quantize import Int8WeightOnly, SmoothQuantW8A8, W8A8Linear
from infopt.quantize.formats.w8a8 import int_mm_supported


def _quantized(step):
    model = tiny_model("llama")
    ids = torch.randint(3, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    infopt.optimize(model, [step], calibration=ids)
    return model


@pytest.mark.parametrize("step", [SmoothQuantW8A8(samples=2, seq_len=32), Int8WeightOnly()],
                         ids=["smoothquant", "int8"])
def test_quantized_model_through_the_engine_gives_its_own_greedy_tokens(step):
    ref, model = _quantized(step), _quantized(step)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 4000) for _ in range(rng.randint(1, 70))] for _ in range(12)]
    lengths = [rng.randint(1, 16) for _ in prompts]
    # steps of up to 48 rows: chunked prompts next to decoding rows, as in a served batch
    eng = Engine(model, max_batch_tokens=48, max_seqs=8, kv=Paged(block_size=4, num_blocks=200))
    outs = eng.generate(prompts, [SamplingParams(max_new_tokens=n) for n in lengths])
    for p, n, o in zip(prompts, lengths, outs, strict=True):
        solo = ref.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
        assert o.token_ids == solo, (len(p), n)
    w8a8 = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    assert bool(w8a8) == isinstance(step, SmoothQuantW8A8)
    if w8a8 and int_mm_supported(torch.device("cpu"), 48, 64, 64)[0]:
        assert all(m.last_kernel == "int_mm" for m in w8a8)
