"""Where greedy outputs part from the baseline, and whether each parting is a near-tie of the reference."""

import pytest
import torch

from infopt.bench import run_bench
from infopt.bench.divergence import NEAR_TIE, divergences, near_tie_margin, summarize_divergences
from infopt.models import tiny_model

PROMPTS = [torch.tensor([[1, 17, 400, 23]]), torch.tensor([[5, 6, 7]])]


def _greedy(m, p, n=6):
    return m.generate(p, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)[0, p.shape[1]:].tolist()


def test_the_first_differing_token_and_the_references_margin_there():
    m = tiny_model("llama")
    ref = [_greedy(m, p) for p in PROMPTS]
    assert divergences(m, PROMPTS, ref, ref) == []
    other = [ref[0], ref[1][:3] + [(ref[1][3] + 1) % 1000] + ref[1][4:]]
    (d,) = divergences(m, PROMPTS, ref, other)
    assert (d["request"], d["position"], d["reference_token"], d["token"]) == (1, 3, ref[1][3], other[1][3])
    with torch.no_grad():  # the margin is the reference's own top-2 gap at that step, teacher-forced on its tokens
        logits = m(torch.cat([PROMPTS[1], torch.tensor([ref[1][:3]])], dim=1)).logits[0, -1]
    top2 = logits.topk(2).values
    assert d["margin"] == pytest.approx(float(top2[0] - top2[1]), abs=1e-6)
    assert d["gap"] == pytest.approx(float(logits[ref[1][3]] - logits[other[1][3]]), abs=1e-6)
    assert d["near_tie"] is (d["margin"] < NEAR_TIE["float32"])


def test_near_tie_margins_by_dtype_and_the_summary_line():
    assert near_tie_margin(torch.float32) == 0.02 and near_tie_margin("torch.bfloat16") == 0.25
    found = [{"request": 3, "position": 97, "margin": 0.004, "near_tie": True},
             {"request": 9, "position": 11, "margin": 1.5, "near_tie": False}]
    line = summarize_divergences(found, 64, torch.float32)
    assert "2 of 64 requests" in line and "#3 at token 97 (margin 0.004)" in line
    assert "1 above the near-tie margin 0.02" in line
    assert "all near-ties (reference top-2 margin < 0.02 in float32)" in summarize_divergences(found[:1], 64, "float32")
    assert summarize_divergences([], 8, "float32") == "greedy outputs identical to the baseline on all 8 requests"


def test_bench_reports_the_margins_where_the_optimized_run_parts(tok, monkeypatch):
    """The bench finds the parting of each request and measures the reference's margin there (a tiny random model
    decodes the same tokens under any quantization, so the optimized run's tokens are changed at a known place)."""
    from infopt.bench import format_table, harness

    real = harness._timed

    def timed(model, requests, mode, pad, progress, desc):
        m, toks = real(model, requests, mode, pad, progress, desc)
        if desc.startswith("optimized"):
            toks[1] = toks[1][:2] + [(toks[1][2] + 1) % 1000] + toks[1][3:]
        return m, toks

    monkeypatch.setattr(harness, "_timed", timed)
    m = tiny_model("llama", max_positions=2048)
    res = run_bench(m, tok, [{"kvcache": {"kind": "static"}}], "batch", repeats=1, num_requests=3, progress=False)
    assert res["fidelity"] == "lossless" and res["exact_greedy"] is False
    (d,) = res["divergences"]
    assert (d["request"], d["position"]) == (1, 2) and d["margin"] >= 0
    assert "greedy outputs part from the baseline on 1 of 3 requests: #1 at token 2" in format_table(res)


@pytest.fixture(scope="module")
def tok():
    from infopt.models import load_default_tokenizer

    return load_default_tokenizer()
