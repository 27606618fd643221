"""Bench results render as tables in notebooks; the chart leaves the caller's matplotlib backend alone."""

import json

import pytest

from infopt.bench.report import BenchResult, format_table, plot


def _result():
    base = {"decode_tokens_per_s": 10.0, "tokens_per_s": 10.0, "ttft_p50_ms": 5.0, "model_mb": 4.0,
            "peak_rss_mb": 100.0, "weight_gbs": 1.0}
    opt = {**base, "decode_tokens_per_s": 25.0, "model_mb": 1.0}
    return {"machine": {"cpu": "host <cpu>", "threads": 2, "torch": "t", "transformers": "tf", "infopt": "i",
                        "date": "2026-01-01T00:00:00+00:00", "bandwidth_gbs": 30.0},
            "model": "tiny", "workload": {"name": "decode", "description": "d", "requests": 1, "prompt_tokens": 32,
                                          "output_tokens": 128, "dtype": "torch.float32", "repeats": 1, "seed": 0},
            "recipe": {"steps": [{"quantize": {"method": "int8"}}]}, "baseline": dict(base),
            "baseline_modes": {"sequential": dict(base)}, "optimized": opt,
            "ratios": {k: opt[k] / base[k] for k in base}, "ratios_by_mode": None, "ratio_baseline": "sequential",
            "quality": {"kl": 0.001, "kl_max": 0.05, "top1": 0.99, "ppl_ref": 10.0, "ppl": 10.1},
            "compile": None, "exact_greedy": False}


def test_bench_result_is_the_dict_and_renders_as_a_table():
    plain = _result()
    r = BenchResult(plain)
    assert r == plain and json.loads(json.dumps(r)) == json.loads(json.dumps(plain))
    assert str(r) == format_table(plain)
    html = r._repr_html_()
    assert "<table>" in html and "<th>HF sequential</th><th>infopt</th><th>ratio</th>" in html
    assert "<th style='text-align:left'>decode tokens/s</th><td style='text-align:right'>10</td>" in html
    assert "2.5x" in html and "host &lt;cpu&gt;" in html and "<li>quality vs original: KL 0.001" in html
    md = r._repr_markdown_()
    assert "| | HF sequential | infopt | ratio |" in md and "| decode tokens/s | 10 | 25 | 2.5x |" in md
    assert "- greedy outputs identical to baseline: no" in md


def test_a_lossless_recipe_parting_in_16_bit_floats_is_explained():
    r = {**_result(), "lossless_claimed": True}
    assert "no (recipe claims lossless)" in format_table(r)  # float32: a real difference, stated as such
    r["workload"] = {**r["workload"], "dtype": "torch.bfloat16"}
    text = format_table(r)
    assert "recipe claims lossless: in bfloat16" in text and "--dtype float32" in text
    r["exact_greedy"] = True
    assert format_table(r).endswith("identical to baseline: yes (recipe claims lossless)")


def test_plot_keeps_the_matplotlib_backend(tmp_path):
    mpl = pytest.importorskip("matplotlib")
    before = mpl.get_backend()
    mpl.use("svg")
    try:
        png = plot(_result(), tmp_path / "r.png")
        assert png.stat().st_size > 1000 and mpl.get_backend() == "svg"
    finally:
        mpl.use(before)


def test_progress_bars_pick_the_notebook_kind():
    """Every progress bar is tqdm.auto's: widgets in a notebook, text elsewhere."""
    import re
    from pathlib import Path

    import infopt

    src = Path(infopt.__file__).parent
    users = {p.relative_to(src).as_posix(): p.read_text() for p in src.rglob("*.py") if "tqdm" in p.read_text()}
    assert "quantize/algorithms/layerwise.py" in users and "bench/harness.py" in users
    for name, text in users.items():
        imports = re.findall(r"^\s*(from tqdm[\w.]* import \w+|import tqdm[\w.]*)", text, flags=re.M)
        assert imports and all(i.strip() == "from tqdm.auto import tqdm" for i in imports), (name, imports)
