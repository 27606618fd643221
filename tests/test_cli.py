import subprocess
import sys

import pytest
import torch

from infopt.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    import infopt

    assert capsys.readouterr().out.strip() == f"infopt {infopt.__version__}"


def test_recipes_lists_presets(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    for name in ("cpu-fast", "cpu-lossless", "memory-saver", "gpu-fast"):
        assert name in out
    assert "quantize: " in out and " int8" in out


def test_optimize_and_save_roundtrip(tmp_path, capsys, prompt):
    from infopt.io import load_optimized
    from infopt.models import tiny_model

    src = tmp_path / "tiny"
    m = tiny_model("llama")
    m.save_pretrained(src)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("steps:\n  - quantize: {method: int8}\n  - kvcache: {kind: static, max_length: 64}\n")
    assert main(["optimize", "--recipe", str(recipe), "--model", str(src), "--save", str(tmp_path / "out")]) == 0
    assert "quantize:int8" in capsys.readouterr().out
    m2, _ = load_optimized(tmp_path / "out")
    import infopt

    infopt.optimize(m, str(recipe))
    assert torch.equal(m2(prompt).logits, m(prompt).logits)


def test_bad_recipe_exit_code_and_message(tmp_path, capsys):
    from infopt.models import tiny_model

    src = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(src)
    assert main(["optimize", "--recipe", "nope", "--model", str(src)]) == 2
    assert "neither a preset" in capsys.readouterr().err


def test_console_script_entry_point():
    out = subprocess.run([sys.executable, "-m", "infopt.cli", "recipes"], capture_output=True, text=True, check=True)
    assert "presets:" in out.stdout


@pytest.mark.slow
def test_python_dash_m_infopt():
    out = subprocess.run([sys.executable, "-m", "infopt", "recipes"], capture_output=True, text=True, check=True)
    assert "presets:" in out.stdout and "--fields" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "infopt", "optimize", "--recipe", "cpu_fast", "--model", "nowhere"],
                         capture_output=True, text=True)
    assert bad.returncode == 2


def test_recipes_fields_lists_every_step_with_types_and_defaults(capsys):
    import dataclasses

    from infopt.core.step import STEP_TYPES

    assert main(["recipes", "--fields"]) == 0
    out = capsys.readouterr().out
    for stage, kinds in STEP_TYPES.items():
        for kind, cls in kinds.items():
            assert f"{stage}{':' + kind if kind else ''}  ({cls.__name__}" in out
            for f in dataclasses.fields(cls):
                assert f"    {f.name} " in out
    lines = out.splitlines()
    i = lines.index("quantize:int4  (Int4WeightOnly, method: int4)")
    block = lines[i:lines.index("", i)]
    assert any(line.split() == ["group_size", "int", "=", "128"] for line in block)
    assert any(line.split() == ["include_lm_head", "bool", "=", "False"] for line in block)
    assert "kvcache:static  (Static, kind: static)" in out
    assert any(line.split() == ["max_length", "int", "|", "None", "=", "None"] for line in lines)


def test_recipes_fields_one_stage_or_kind(capsys):
    assert main(["recipes", "--fields", "kvcache:static"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("kvcache:static  (Static, kind: static)") and "quantize" not in out
    assert main(["recipes", "--fields", "attention"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("attention  (Attention)")
    assert [line.split() for line in out.splitlines()[2:]] == [["backend", "str", "=", "'sdpa'"],
                                                                ["prompt_dtype", "str", "|", "None", "=", "None"]]
    assert main(["recipes", "--fields", "quantise"]) == 2
    assert "Did you mean 'quantize'?" in capsys.readouterr().err
    assert main(["recipes", "--fields", "quantize:int3"]) == 2
    assert "Did you mean 'int4' or 'int8'?" in capsys.readouterr().err


def test_unknown_preset_suggests_the_closest(tmp_path, capsys):
    assert main(["optimize", "--recipe", "cpu_fast", "--model", str(tmp_path)]) == 2
    assert "Did you mean 'cpu-fast'?" in capsys.readouterr().err


# -- infopt recipes NAME: a preset as a recipe file, with its measured figures ---------------------------------------


def _comments_and_yaml(out: str) -> tuple[str, str]:
    lines = out.splitlines()
    comments = [ln[2:] if ln.startswith("# ") else ln[1:] for ln in lines if ln.startswith("#")]
    assert lines[:len(comments)] == [ln for ln in lines if ln.startswith("#")], "the comments come first"
    return " ".join(" ".join(comments).split()), "\n".join(lines[len(comments):])


@pytest.mark.parametrize("name", ["cpu-lossless", "cpu-fast", "memory-saver", "throughput", "gpu-fast"])
def test_recipes_name_prints_the_preset_as_the_yaml_optimize_reads(name, tmp_path, capsys):
    from infopt.recipe import PRESETS, Recipe

    assert main(["recipes", name, "--results", str(tmp_path / "absent")]) == 0
    comments, text = _comments_and_yaml(capsys.readouterr().out)
    assert Recipe.from_yaml(text) == Recipe.parse(name)  # the whole output is a recipe file: comments, then YAML
    assert " ".join(PRESETS[name].description.split()) in comments
    # an installed wheel has no benchmarks/: the figures' home is named, none is made up
    assert "not installed with the package" in comments and "apply time:" not in comments and "MiB" not in comments
    assert f"infopt optimize --recipe {name}" in comments
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    assert Recipe.parse(str(path)).steps == Recipe.parse(name).steps


def _bench_file(name: str, steps: list, *, date="2026-11-21T10:00:00+00:00", model="SmolLM2-135M-Instruct",
                quality=True) -> dict:
    row = {"tokens_per_s": 10.0, "model_mb": 500.0, "peak_rss_mb": 1000.0}
    return {"machine": {"cpu": "Test CPU", "threads": 2, "date": date}, "model": model,
            "workload": {"name": "decode", "description": "a test workload"}, "recipe": {"name": name, "steps": steps},
            "baseline": row, "optimized": {"tokens_per_s": 25.0, "model_mb": 125.0, "peak_rss_mb": 800.0},
            "quality": {"kl": 0.0123, "kl_max": 0.05, "top1": 0.95, "ppl": 18.0, "ppl_ref": 17.5, "tokens": 512}
            if quality else None, "exact_greedy": False}


def test_recipes_name_quotes_each_figure_with_its_file(tmp_path, capsys):
    import json

    from infopt.recipe import Recipe

    steps = Recipe.parse("memory-saver").to_dict()["steps"]
    (tmp_path / "decode-memory-saver.json").write_text(json.dumps(_bench_file("memory-saver", steps)))
    # a newer run of another workload, and one on another model: the standard run's file is quoted, not these
    (tmp_path / "prompt512-memory-saver.json").write_text(
        json.dumps(_bench_file("memory-saver", steps, date="2026-11-25T10:00:00+00:00")))
    (tmp_path / "decode-memory-saver-other.json").write_text(
        json.dumps(_bench_file("memory-saver", steps, model="random:qwen2")))
    (tmp_path / "broken.json").write_text("{")  # skipped, not fatal
    assert main(["recipes", "memory-saver", "--results", str(tmp_path)]) == 0
    comments, _ = _comments_and_yaml(capsys.readouterr().out)
    assert "apply time: not measured" in comments  # no startup-memory-saver.json: nothing invented
    assert ("memory: parameters+buffers 500.0 -> 125.0 MiB (x0.25), peak RSS 1000 -> 800 MiB against plain "
            "transformers (decode-memory-saver.json: baseline/optimized model_mb, peak_rss_mb; Test CPU, 2 threads, "
            "2026-11-21)") in comments
    assert ("quality: KL 0.0123 nats/token (max 0.0500), top-1 agreement 95.00%, perplexity 18.00 against 17.50 "
            "over 512 tokens; greedy tokens identical to plain transformers: no (decode-memory-saver.json: quality, "
            "exact_greedy)") in comments
    assert "speed: 10.0 -> 25.0 tokens/s (x2.50) on a test workload (decode-memory-saver.json: tokens_per_s)" \
        in comments
    assert "also measured in: prompt512-memory-saver.json" in comments and "other.json" not in comments
    assert "earlier form" not in comments  # the recorded recipe is today's


def test_recipes_name_says_when_the_measured_recipe_was_an_earlier_form(tmp_path, capsys):
    import json

    old = [{"quantize": {"method": "int4", "group_size": 32, "include_lm_head": True, "dense_prefill": True}}]
    (tmp_path / "decode-cpu-fast.json").write_text(json.dumps(_bench_file("cpu-fast", old, quality=False)))
    (tmp_path / "startup-cpu-fast.json").write_text(json.dumps(
        {"machine": {"cpu": "Test CPU", "threads": 2, "date": "2026-11-22T00:00:00"}, "recipe": "cpu-fast",
         "optimize_s": 12.34}))
    (tmp_path / "startup-cpu-fast-warm.json").write_text(json.dumps(
        {"machine": {"cpu": "Test CPU", "threads": 2, "date": "2026-11-23T00:00:00"}, "recipe": "cpu-fast",
         "optimize_s": 4.5}))
    assert main(["recipes", "cpu-fast", "--results", str(tmp_path)]) == 0
    comments, _ = _comments_and_yaml(capsys.readouterr().out)
    assert ("apply time: 12.3 s for infopt.optimize, compile caches as that run found them (startup-cpu-fast.json: "
            "optimize_s; Test CPU, 2 threads, 2026-11-22); other runs, with other cache states: 4.5 s "
            "(startup-cpu-fast-warm.json, 2026-11-23)") in comments
    assert "quality: not measured" in comments
    assert "decode-cpu-fast.json recorded an earlier form of this preset (steps then: quantize; now: attention, " \
           "quantize, kvcache, compile; quantize.dense_prefill true then, false now; quantize.activations not recorded then, " \
           "auto now; quantize.share_embedding not recorded then, true now; quantize.max_kl not recorded then, 0.02 " \
           "now)" in comments


def test_recipes_name_gives_the_first_apply_on_a_new_machine_and_the_warm_one(tmp_path, capsys):
    """An apply-time study (``benchmarks/studies/apply_time.py``) says what a user waits for on a new machine and
    after; it is quoted before a saved-folder run's single figure, whose cache state was not recorded; the newest
    study naming the preset wins."""
    import json

    def study(cold, warm, date, name="cpu-fast"):
        return {"machine": {"cpu": "Test CPU", "threads": 2, "date": date},
                "summary": {name: {"cold_apply_s": cold, "warm_apply_s_median": warm}}}

    (tmp_path / "startup-cpu-fast.json").write_text(json.dumps(
        {"machine": {"cpu": "Test CPU", "threads": 2, "date": "2026-11-22T00:00:00"}, "recipe": "cpu-fast",
         "optimize_s": 12.34}))
    (tmp_path / "apply_time_old.json").write_text(json.dumps(study(300.0, 9.0, "2026-11-20T00:00:00")))
    (tmp_path / "apply_time_new.json").write_text(json.dumps(study(151.2, 2.94, "2026-12-01T00:00:00")))
    (tmp_path / "apply_time_other.json").write_text(json.dumps(study(10.0, 1.0, "2026-12-02T00:00:00", "throughput")))
    assert main(["recipes", "cpu-fast", "--results", str(tmp_path)]) == 0
    comments, _ = _comments_and_yaml(capsys.readouterr().out)
    assert ("apply time: 151 s for infopt.optimize on a new machine (empty compile caches), 2.9 s in later processes "
            "(the caches filled) (apply_time_new.json: summary.cpu-fast: cold_apply_s, warm_apply_s_median; Test CPU, "
            "2 threads, 2026-12-01)") in comments
    assert "12.3 s" not in comments and "300 s" not in comments


def test_recipes_name_reads_the_repositorys_results(capsys):
    """From a source checkout the figures come from benchmarks/results: the standard decode run's file."""
    import json
    from pathlib import Path

    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    data = json.loads((results / "decode-memory-saver.json").read_text())
    assert main(["recipes", "memory-saver"]) == 0
    comments, _ = _comments_and_yaml(capsys.readouterr().out)
    mb = data["optimized"]["model_mb"]
    assert f"-> {mb:.1f} MiB" in comments and "(decode-memory-saver.json: baseline/optimized" in comments
    assert f"KL {data['quality']['kl']:.4f} nats/token" in comments


def test_recipes_unknown_name_suggests_and_lists(capsys):
    from infopt.recipe import PRESETS

    assert main(["recipes", "cpu_fast"]) == 2
    err = capsys.readouterr().err
    assert "unknown preset 'cpu_fast'. Did you mean 'cpu-fast'?" in err
    assert f"Presets: {', '.join(PRESETS)}" in err
    assert main(["recipes", "cpu-fast", "--fields"]) == 2
    assert "not both" in capsys.readouterr().err


def test_recipes_name_reads_a_recipe_file(tmp_path, capsys):
    from infopt.recipe import Recipe

    path = tmp_path / "mine.yaml"
    path.write_text("steps:\n  - kvcache: {kind: static, max_length: 64}\n")
    assert main(["recipes", str(path)]) == 0
    comments, text = _comments_and_yaml(capsys.readouterr().out)
    assert f"recipe file {path}: kvcache:static" in comments
    assert Recipe.from_yaml(text).steps == Recipe.parse(str(path)).steps
    assert "max_length: 64" in text and "batch_size: null" in text  # every field, defaults filled in


# -- infopt optimize --dry-run ----------------------------------------------------------------------------------------


def test_optimize_dry_run_prints_the_plan_and_changes_nothing(tmp_path, capsys):
    import infopt
    from infopt.models import load_model, tiny_model

    src = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(src)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    out_dir = tmp_path / "out"
    assert main(["optimize", "--recipe", "cpu-fast", "--model", str(src), "--dry-run", "--save", str(out_dir)]) == 0
    out = capsys.readouterr().out
    model, _ = load_model(src)
    assert out == infopt.explain(model, "cpu-fast") + (  # one implementation: the CLI prints explain's text
        f"\n--dry-run: nothing was saved; without it the optimized model would be saved to {out_dir}\n")
    assert not out_dir.exists()
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before


def test_optimize_dry_run_refuses_what_optimize_refuses(tmp_path, capsys):
    from infopt.models import tiny_model

    src = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(src)
    assert main(["optimize", "--recipe", "gpu-fast", "--model", str(src), "--dry-run"]) == 2
    assert "preset 'gpu-fast' does not apply to this model (cpu)" in capsys.readouterr().err


def test_recipes_name_from_an_installed_wheel_names_where_figures_live(monkeypatch, tmp_path, capsys):
    """An installed package has no benchmarks/ beside it: the default results folder is absent."""
    import infopt.cli as cli
    from infopt.recipe import Recipe

    monkeypatch.setattr(cli, "_source_results", lambda: tmp_path / "site-packages" / "benchmarks" / "results")
    assert main(["recipes", "cpu-fast"]) == 0
    comments, text = _comments_and_yaml(capsys.readouterr().out)
    assert "kept in benchmarks/results/*.json of the infopt source repository, which is not installed" in comments
    assert "not measured" not in comments and "MiB" not in comments
    assert Recipe.from_yaml(text) == Recipe.parse("cpu-fast")
