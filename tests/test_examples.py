"""The example scripts run (on a tiny model, to stay fast)."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.slow
@pytest.mark.parametrize("script", ["quickstart.py", "recipe_file.py", "quantize_int4.py", "kvcache_prefix.py",
                                    "speculative_decoding.py", "batching_stream.py", "tp_generate.py"])
def test_example_runs(script):
    out = subprocess.run([sys.executable, str(EXAMPLES / script), "--tiny"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "infopt report" in out.stdout


def _execute_notebook(path: Path, tmp_path: Path, **env: str):
    """Run a notebook top to bottom in a fresh kernel of this interpreter; returns the executed notebook."""
    import json
    import os

    reason = "nbclient is not installed: pip install -e '.[dev]' (the dev extra has nbclient, nbformat, ipykernel)"
    nbclient = pytest.importorskip("nbclient", reason=reason)
    nbformat = pytest.importorskip("nbformat", reason=reason)
    # a kernel spec of its own, so the kernel is this interpreter whatever 'python3' names on this machine
    spec = tmp_path / "jupyter" / "kernels" / "infopt-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "infopt test", "language": "python"}))
    old = {k: os.environ.get(k) for k in ("JUPYTER_PATH", *env)}
    os.environ.update({"JUPYTER_PATH": str(tmp_path / "jupyter"), **env})
    try:
        nb = nbformat.read(path, as_version=4)
        nbclient.NotebookClient(nb, timeout=300, kernel_name="infopt-test",
                                resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


@pytest.mark.parametrize("tiny", ["1", pytest.param("0", marks=[pytest.mark.real_model, pytest.mark.slow])],
                         ids=["tiny", "default-model"])
def test_walkthrough_notebook_runs(tiny, tmp_path):
    nb = _execute_notebook(EXAMPLES / "walkthrough.ipynb", tmp_path, INFOPT_WALKTHROUGH_TINY=tiny)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    html = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    assert any("<b>infopt report</b>" in h and "<code>quantize:int8</code>" in h for h in html)  # model.infopt
    assert any("<th>HF sequential</th><th>infopt</th><th>ratio</th>" in h for h in html)  # the bench result
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the chart, inline
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "Did you mean 'include_lm_head'?" in text and "greedy output identical to the original" in text
    assert "top-1 agreement" in text and "group_size" in text
