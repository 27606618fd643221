"""The example scripts run (on a tiny model, to stay fast)."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("script", ["quickstart.py", "recipe_file.py", "quantize_int4.py", "kvcache_prefix.py",
                                    "speculative_decoding.py", "batching_stream.py", "tp_generate.py"])
def test_example_runs(script):
    out = subprocess.run([sys.executable, str(EXAMPLES / script), "--tiny"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "infopt report" in out.stdout
