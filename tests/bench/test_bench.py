import json

import pytest
import torch

from infopt.bench import (
    WORKLOADS,
    append_csv,
    compare_runs,
    format_table,
    make_workload,
    measure_bandwidth,
    plot,
    run_bench,
    run_requests,
    summarize,
)
from infopt.models import tiny_model


@pytest.fixture(scope="module")
def tok():
    from infopt.models import load_default_tokenizer

    return load_default_tokenizer()


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_workloads_are_seeded_and_shaped(tok, name):
    a = make_workload(name, tok, seed=1)
    b = make_workload(name, tok, seed=1)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.input_ids, y.input_ids) and x.max_new_tokens == y.max_new_tokens
    if name == "decode":
        assert a[0].prompt_len == 32 and a[0].max_new_tokens == 128
    if name == "batch":
        assert len(a) == 64
        assert all(16 <= r.max_new_tokens <= 256 for r in a)
        assert min(r.prompt_len for r in a) >= 16
    if name == "prefix":
        common = min(r.prompt_len for r in a)
        assert common > 900
        assert all(torch.equal(r.input_ids[0, :900], a[0].input_ids[0, :900]) for r in a)


def test_unknown_workload(tok):
    with pytest.raises(ValueError, match="allowed: decode"):
        make_workload("stress", tok)


def test_padded_and_sequential_serve_exact_lengths(tok):
    m = tiny_model("llama", max_positions=2048)
    reqs = make_workload("batch", tok, num_requests=3)
    seq = run_requests(m, reqs, mode="sequential")
    pad = run_requests(m, reqs, mode="padded", batch_size=2)
    for r, s, p in zip(reqs, seq["requests"], pad["requests"], strict=True):
        assert len(s["tokens"]) == len(p["tokens"]) == r.max_new_tokens
        assert 0 < s["ttft"] <= s["total"]
    m_seq = summarize(seq)
    assert m_seq["output_tokens"] == sum(r.max_new_tokens for r in reqs)
    assert m_seq["tokens_per_s"] > 0


def test_run_bench_lossless_recipe_is_exact_and_reports_ratios(tok, tmp_path):
    m = tiny_model("llama", max_positions=2048)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    res = run_bench(m, tok, "cpu-lossless", "decode", repeats=2, progress=False)
    assert res["exact_greedy"] is True and res["lossless_claimed"] is True
    assert res["quality"]["kl"] == 0.0 and res["quality"]["top1"] == 1.0
    assert set(res["ratios"]) == set(res["optimized"])
    assert res["ratios"]["model_mb"] == pytest.approx(1.0)
    assert res["machine"]["bandwidth_gbs"] > 0
    for k, v in m.state_dict().items():  # the model is handed back unoptimized
        assert torch.equal(v, before[k])
    assert "generate" not in m.__dict__
    text = format_table(res)
    assert "decode tokens/s" in text and "greedy outputs identical to baseline: yes" in text
    json.loads(json.dumps(res))
    png = plot(res, tmp_path / "r.png")
    assert png.stat().st_size > 1000
    csv = append_csv(res, tmp_path / "hist.csv")
    append_csv(res, csv)
    assert len(csv.read_text().strip().splitlines()) == 3
    assert "B/A" in compare_runs(res, res)


def test_run_bench_lossy_recipe_measures_quality(tok):
    m = tiny_model("llama", max_positions=2048)
    # without the head: on this tiny model the 49k-row head is most of the weights, and an int8 head beside
    # the tied fp32 embedding would grow them
    recipe = [{"quantize": {"method": "int4", "group_size": 32}}]
    res = run_bench(m, tok, recipe, "batch", repeats=1, num_requests=3, progress=False)
    assert set(res["baseline_modes"]) == {"sequential", "padded"}
    assert res["lossless_claimed"] is False
    assert res["quality"]["kl"] > 0
    assert res["ratios"]["model_mb"] < 1.0


def test_baseline_only(tok):
    m = tiny_model("llama", max_positions=2048)
    res = run_bench(m, tok, "none", "decode", repeats=1, progress=False)
    assert res["optimized"] is None and res["ratios"] is None and res["exact_greedy"] is None
    assert "none (baseline only)" in format_table(res)


def test_bandwidth_positive():
    assert measure_bandwidth(size_mb=16, repeats=2) > 0.1


def test_cli_bench_and_compare(tmp_path, tok, capsys):
    from infopt.cli import main

    src = tmp_path / "tiny"
    m = tiny_model("llama", max_positions=2048)
    m.save_pretrained(src)
    tok.save_pretrained(src)
    out = tmp_path / "a.json"
    assert main(["bench", "--model", str(src), "--workload", "decode", "--recipe", "cpu-lossless", "--repeats", "1",
                 "--json", str(out), "--quiet"]) == 0
    assert "decode tokens/s" in capsys.readouterr().out
    assert main(["bench", "--compare", str(out), str(out)]) == 0
    assert "1x" in capsys.readouterr().out
