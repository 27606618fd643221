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
