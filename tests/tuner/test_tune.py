"""infopt.tune on tiny models: the gate, dominance, the budget, the result's table/YAML/chart, and the CLI."""

import json

import pytest
import torch

import infopt
from infopt.cli import main
from infopt.kvcache import Static
from infopt.models import tiny_model
from infopt.quantize import Int4WeightOnly, Int8WeightOnly
from infopt.quantize.calibration.cache import weights_fingerprint
from infopt.recipe import Recipe
from infopt.speculative import PromptLookup
from infopt.tuner import Candidate, TuneResult, default_candidates, parse_gate
from infopt.tuner.candidates import as_candidates

WORKLOAD = "prompt512"  # one request, 16 new tokens: the quickest workload


def small():
    return tiny_model(max_positions=1024, with_tokenizer=True)


def run(model, tok, candidates, gate, **kw):
    return infopt.tune(model, tok, WORKLOAD, gate=gate, candidates=candidates, repeats=1, num_requests=1,
                       progress=False, **kw)


def int4(g, level):
    r = Recipe.parse([Int4WeightOnly(group_size=g)])
    return Candidate(f"int4-g{g}", r, family="int4", level=level)


@pytest.fixture(scope="module")
def kl_run():
    """One search under a KL gate int4 misses and int8 passes, shared by the tests that read it."""
    m, tok = small()
    before = weights_fingerprint(m)
    cands = [[Static()], [Int8WeightOnly()], int4(32, 0), int4(64, 1), [Int4WeightOnly(group_size=128)],
             [PromptLookup(num_tokens=4), Static()]]
    result = run(m, tok, cands, {"max_kl": 1e-5})
    return m, tok, before, result


@pytest.mark.slow
def test_kl_gate_statuses(kl_run):
    _, _, _, r = kl_run
    status = {t.name: t.status for t in r.trials}
    assert status["int4-g32"] == "gate" and "max_kl" in r.trials[2].reason
    assert r.trials[2].speed is None and r.trials[2].kl > 1e-5  # rejected by the quality check, never timed
    assert status["int4-g64"] == "dominated"  # coarser than a setting that missed
    assert status["quantize:int4"] == "invalid"  # the default group 128 does not divide the tiny model's 64 channels
    assert r.trials[1].kl is not None and r.trials[1].kl <= 1e-5


def test_best_is_the_fastest_passing_candidate(kl_run):
    _, _, _, r = kl_run
    passing = [t for t in r.trials if t.status in ("pass", "best")]
    assert len(passing) == 3 and all(t.speedup is not None for t in passing)
    assert r.best is max(passing, key=lambda t: t.speedup)
    assert [t.status for t in passing].count("best") == 1
    assert not r.higher and r.metric == "ttft_p50_ms"  # prompt512 ranks by time to first token


def test_model_left_as_it_was(kl_run):
    m, _, before, _ = kl_run
    assert getattr(m, "infopt", None) is None
    assert weights_fingerprint(m) == before


@pytest.mark.slow
def test_yaml_round_trips_through_optimize(kl_run, tmp_path, prompt):
    _, _, _, r = kl_run
    path = r.save_yaml(tmp_path / "tuned.yaml")
    loaded = Recipe.parse(str(path))
    assert loaded.steps == r.best.recipe.steps and loaded.gate == {"max_kl": 1e-5}
    m2, tok2 = small()
    ref = m2.generate(prompt, max_new_tokens=5, do_sample=False)
    infopt.optimize(m2, str(path), tokenizer=tok2)
    assert [s.key for s in m2.infopt.steps] == [s.key for s in r.best.recipe.steps]
    if r.best.exact:
        assert torch.equal(m2.generate(prompt, max_new_tokens=5, do_sample=False), ref)


def test_table_json_and_chart(kl_run, tmp_path):
    _, _, _, r = kl_run
    md = r._repr_markdown_()
    assert md.count("\n| ") == len(r.trials) + 1 and "best:" in md
    d = json.loads(json.dumps(r.to_dict()))
    assert d["best"]["steps"] == [s.to_dict() for s in r.best.recipe.steps]
    png = r.plot(tmp_path / "tune.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lossless_gate_rejects_lossy_and_checks_tokens():
    m, tok = small()
    r = run(m, tok, [[Int8WeightOnly()], [Static()], "cpu-fast"], "lossless")
    assert [t.status for t in r.trials] == ["not lossless", "best", "not lossless"]
    assert r.trials[0].speed is None and r.trials[2].speed is None
    assert r.best.exact is True and r.best.kl is None  # lossless: the tokens are checked, no KL is measured


def test_budget_stops_the_search(monkeypatch):
    import types

    from infopt.tuner import search

    m, tok = small()
    r = run(m, tok, [[Static()], [Int8WeightOnly()]], {"max_kl": 1.0}, budget_s=1e-3)
    assert [t.status for t in r.trials] == ["budget", "budget"] and r.best is None  # nothing fits 1 ms
    # a clock that advances 10 s per reading: the first candidate starts at 10 s (of 35) and takes 20 s, so the
    # next would start at 40 s: past the budget
    ticks = iter(range(0, 10**6, 10))
    monkeypatch.setattr(search, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    r = run(m, tok, [[Static()], [Int8WeightOnly()], [PromptLookup()]], {"max_kl": 1.0}, budget_s=35)
    assert [t.status for t in r.trials] == ["best", "budget", "budget"]
    assert r.trials[1].speed is None and "s spent" in r.trials[1].reason


def test_no_passing_candidate():
    m, tok = small()
    r = run(m, tok, [[Int4WeightOnly(group_size=32)]], {"max_kl": 1e-9})
    assert r.best is None and r.recipe is None
    with pytest.raises(infopt.RecipeError, match="no candidate passed"):
        r.save_yaml("never.yaml")


@pytest.mark.parametrize("gate,msg", [("max_kl", "KEY=NUMBER"), ({"max_kll": 0.1}, "max_kll"), ({}, "mapping"),
                                      ("min_top1=98", "out of range")], ids=["no-value", "typo", "empty", "percent"])
def test_bad_gate(gate, msg):
    with pytest.raises(infopt.RecipeError, match=msg):
        parse_gate(gate)


def test_refuses_an_optimized_model():
    m, tok = small()
    infopt.optimize(m, [Static()])
    with pytest.raises(infopt.RecipeError, match="already optimized"):
        run(m, tok, [[Static()]], "lossless")


def test_default_candidates_fit_the_rules_and_the_gate_split():
    cands = default_candidates("decode", calibrated=True)
    names = [c.name for c in cands]
    assert len(names) == len(set(names)) and "preset:cpu-fast" in names and "preset:gpu-fast" not in names
    assert len({c.recipe.steps for c in cands}) == len(cands)  # no recipe twice
    assert any(c.lossless for c in cands) and any(not c.lossless for c in cands)
    assert "preset:throughput" in [c.name for c in default_candidates("batch")]
    fast = next(c for c in cands if c.name == "preset:cpu-fast")
    assert fast.family == "int4-auto+static+compile" and fast.level == 0  # the g64/g128 variants are coarser
    with pytest.raises(infopt.RecipeError, match="named"):
        as_candidates([[Static()], [Static()]])


def test_cli(monkeypatch, tmp_path, capsys):
    import infopt.models

    monkeypatch.setattr(infopt.models, "load_model", lambda *a, **k: small())
    (tmp_path / "static.yaml").write_text(Recipe.parse([Static()]).to_yaml())
    rc = main(["tune", "--workload", WORKLOAD, "--gate", "lossless", "--candidates",
               f"cpu-fast,{tmp_path / 'static.yaml'}", "--repeats", "1", "--requests", "1", "--quiet",
               "--save", str(tmp_path / "best.yaml"), "--json", str(tmp_path / "t.json"),
               "--plot", str(tmp_path / "t.png")])
    out = capsys.readouterr().out
    assert rc == 0 and "best: static" in out
    assert Recipe.parse(str(tmp_path / "best.yaml")).steps == (Static(),)
    assert json.loads((tmp_path / "t.json").read_text())["trials"][0]["status"] == "not lossless"
    assert (tmp_path / "t.png").exists()
    assert isinstance(TuneResult, type)
