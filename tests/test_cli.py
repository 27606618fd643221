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
    assert out.startswith("attention  (Attention)") and "backend  str  = 'sdpa'" in out
    assert main(["recipes", "--fields", "quantise"]) == 2
    assert "Did you mean 'quantize'?" in capsys.readouterr().err
    assert main(["recipes", "--fields", "quantize:int3"]) == 2
    assert "Did you mean 'int4' or 'int8'?" in capsys.readouterr().err


def test_unknown_preset_suggests_the_closest(tmp_path, capsys):
    assert main(["optimize", "--recipe", "cpu_fast", "--model", str(tmp_path)]) == 2
    assert "Did you mean 'cpu-fast'?" in capsys.readouterr().err
