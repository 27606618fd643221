"""The suite's device rule (tests/devices.py, wired in tests/conftest.py): a gpu-marked test is the cuda parameter of a
body that also runs on cpu, or sits on the CUDA-only allowlist with its reason; anything else fails collection.

Driven through ``pytester`` on generated test files, with the suite's own conftest copied in (pytester does not load
it otherwise)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tests import devices

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()

PAIRED = """
import pytest

def test_body(device):
    assert device in ("cpu", "cuda")

@pytest.mark.parametrize("arch, device", [("llama", "cpu"), pytest.param("llama", "cuda", marks=pytest.mark.gpu)])
def test_columns(arch, device):
    assert arch == "llama"
"""

UNPAIRED = """
import pytest

def test_fine(device):
    pass

@pytest.mark.gpu
def test_cuda_only():
    pass

@pytest.mark.parametrize("arch, device", [("qwen2", "cpu"), pytest.param("llama", "cuda", marks=pytest.mark.gpu)])
def test_other_arch_on_cpu(arch, device):
    pass
"""


@pytest.fixture
def suite(pytester):
    """A project with the suite's own conftest (its device fixture, skip hook and rule)."""
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    return pytester


def _outcomes(passed: int, cuda: int) -> dict[str, int]:
    """Outcomes of ``passed`` cpu tests and ``cuda`` gpu-marked ones: those pass with CUDA, else are skipped."""
    return {"passed": passed + cuda, "skipped": 0} if CUDA else {"passed": passed, "skipped": cuda}


def test_paired_gpu_tests_collect_and_run_on_cpu(suite):
    suite.makepyfile(test_paired=PAIRED)
    res = suite.runpytest("-v", "-rs")
    res.assert_outcomes(**_outcomes(passed=2, cuda=2))
    res.stdout.fnmatch_lines(["*test_body?cpu? PASSED*", "*test_columns?llama-cpu? PASSED*"])
    if not CUDA:
        res.stdout.fnmatch_lines(["*SKIPPED*needs a CUDA device; none is visible*"])
    res = suite.runpytest("-m", "gpu")  # the rule sees the cpu twins even when -m deselects them
    res.assert_outcomes(**_outcomes(passed=0, cuda=2), deselected=2)


def test_an_unpaired_gpu_test_fails_collection_naming_it_and_both_fixes(suite):
    suite.makepyfile(test_unpaired=UNPAIRED)
    res = suite.runpytest()
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["*2 gpu-marked test(s) without a CPU run of the same body:*",
                              "*test_unpaired.py::test_cuda_only",
                              "*test_unpaired.py::test_other_arch_on_cpu?llama-cuda?",
                              "*take the `device` fixture*CUDA_ONLY with the reason*"])
    res.stdout.no_fnmatch_line("*passed*")
    assert suite.runpytest("-m", "not gpu").ret == pytest.ExitCode.USAGE_ERROR  # deselecting does not hide it


def test_an_allowlisted_gpu_test_passes(suite, monkeypatch):
    suite.makepyfile(test_unpaired=UNPAIRED)
    monkeypatch.setitem(devices.CUDA_ONLY, "test_unpaired.py::test_cuda_only", "CUDA graphs (in this test)")
    monkeypatch.setitem(devices.CUDA_ONLY, "test_unpaired.py::test_other_arch_on_cpu[llama-cuda]", "a node id")
    suite.runpytest().assert_outcomes(**_outcomes(passed=2, cuda=3))


def test_a_cuda_parameter_named_alone_is_not_held_to_its_twin(suite):
    suite.makepyfile(test_paired=PAIRED)
    suite.runpytest("test_paired.py::test_body[cuda]").assert_outcomes(**_outcomes(passed=0, cuda=1))


def test_an_allowlist_entry_needs_a_reason():
    with pytest.raises(ValueError, match=r"CUDA_ONLY\['t.py::test_x'\] has no reason"):
        devices.unpaired_gpu_tests([], {"t.py::test_x": " "})


def test_allowlist_entries_name_tests_that_exist():
    """Each CUDA_ONLY key names a test function defined in its file (a renamed test leaves no stale entry)."""
    for key, reason in devices.CUDA_ONLY.items():
        path, name = key.split("[", 1)[0].split("::")
        tree = ast.parse((ROOT / path).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in names, f"CUDA_ONLY names {key}, which {path} does not define"
        assert len(reason) > 20, key


def test_device_params_mark_cuda_only():
    params = devices.device_params()
    assert [p.values for p in params] == [("cpu",), ("cuda",)]
    assert [[m.name for m in p.marks] for p in params] == [[], ["gpu"]]
    assert set(devices.DEVICES) == {"cpu", "cuda"} and all(d.name == k for k, d in devices.DEVICES.items())
