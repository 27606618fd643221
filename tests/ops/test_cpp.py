"""infopt's C++ kernels: built from the project's files, cached, and a clear fallback where they cannot be."""

import logging

import pytest
import torch

from infopt.ops import cpp


@pytest.fixture
def fresh_state(monkeypatch, tmp_path):
    monkeypatch.setattr(cpp, "_STATE", {})
    monkeypatch.setenv("INFOPT_CACHE_DIR", str(tmp_path))
    return tmp_path / "extensions"


def test_no_compiler_is_a_logged_reason_and_false(fresh_state, monkeypatch, caplog):
    monkeypatch.setattr(cpp, "_compiler", lambda: None)
    monkeypatch.setattr(cpp, "_registered", lambda name: False)  # as in a process that never loaded it
    with caplog.at_level(logging.WARNING, logger="infopt.extensions"):
        assert cpp.load("paged_attention") is False
        assert cpp.load("paged_attention") is False  # the reason is logged once
    assert cpp.status()["paged_attention"] == "no C++ compiler found (install g++ or set CXX)"
    warnings = [r for r in caplog.records if "not available" in r.getMessage()]
    assert len(warnings) == 1 and "torch reference kernel" in warnings[0].getMessage()


def test_disabled_by_environment(fresh_state, monkeypatch):
    monkeypatch.setenv("INFOPT_NO_EXTENSIONS", "1")
    assert cpp.load("paged_attention") is False
    assert "INFOPT_NO_EXTENSIONS" in cpp.status()["paged_attention"]


def test_unknown_kernel_name():
    with pytest.raises(ValueError, match="unknown C\\+\\+ kernel 'nope'; known: paged_attention"):
        cpp.load("nope")


@pytest.mark.slow
@pytest.mark.skipif(cpp._compiler() is None, reason="no C++ compiler on this machine")
def test_builds_into_an_empty_cache_and_reuses_it(fresh_state):
    built = cpp._compiled("paged_attention")
    assert built.parent == fresh_state and built.exists()
    stamp = built.stat().st_mtime_ns
    assert cpp._compiled("paged_attention") == built  # cached, not rebuilt
    assert built.stat().st_mtime_ns == stamp
    # loading: once per process (an already registered operator is not loaded a second time)
    assert cpp.load("paged_attention") is True
    assert cpp.load("paged_attention") is True
    assert hasattr(torch.ops.infopt, "paged_attention")
    # before its first load, a child process saw one of its errors reach Python; the verdict is kept beside it
    assert built.with_name(built.name + ".errors-ok").exists() or cpp._registered("paged_attention")


@pytest.mark.skipif(cpp._compiler() is None, reason="no C++ compiler on this machine")
@pytest.mark.parametrize("name", cpp.KERNELS)
def test_error_probe_raises_a_runtime_error(name):
    """Each kernel's deliberate error reaches Python as a RuntimeError, in this process and in a child process."""
    assert cpp.load(name) is True
    with pytest.raises(RuntimeError, match="infopt error-path probe"):
        getattr(torch.ops.infopt, f"{name}_error_probe")()
    built = cpp._compiled(name)
    for marker in (".errors-ok", ".errors-bad"):
        built.with_name(built.name + marker).unlink(missing_ok=True)
    assert cpp._errors_reach_python(name, built) is True  # the child process's verdict, afresh
    assert built.with_name(built.name + ".errors-ok").exists()


@pytest.mark.slow
@pytest.mark.skipif(cpp._compiler() is None, reason="no C++ compiler on this machine")
def test_a_kernel_whose_errors_crash_is_not_loaded(fresh_state, monkeypatch, caplog):
    """Where an error raised in the library ends the process (a torch built with other exception handling), the
    kernel is refused with that reason, kept beside the library, and the torch kernels are used."""
    import subprocess

    calls = []

    def crashing(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, -11, "", "Fatal Python error: Segmentation fault")

    built = cpp._compiled("paged_attention")  # with the real compiler, before subprocess.run is patched
    monkeypatch.setattr(cpp.subprocess, "run", crashing)
    monkeypatch.setattr(cpp, "_registered", lambda name: False)  # as in a process that never loaded it
    with caplog.at_level(logging.WARNING, logger="infopt.extensions"):
        assert cpp.load("paged_attention") is False
    reason = cpp.status()["paged_attention"]
    assert "does not reach Python" in reason and "signal 11" in reason and torch.__version__ in reason
    assert any("torch reference kernel" in r.getMessage() for r in caplog.records)
    assert built.with_name(built.name + ".errors-bad").read_text() == reason
    monkeypatch.setattr(cpp, "_STATE", {})
    assert cpp.load("paged_attention") is False and len(calls) == 1  # the kept verdict, not a second child


def test_attention_falls_back_to_the_reference_without_the_kernel(monkeypatch):
    """With the C++ kernel unavailable the paged backend runs its torch kernel: same tokens."""
    import infopt
    from infopt.attention import paged
    from infopt.kvcache import Paged
    from infopt.models import tiny_model

    m = tiny_model("llama")
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    ref = m.generate(prompt, max_new_tokens=8, do_sample=False)
    infopt.optimize(m, [Paged(block_size=4)])
    monkeypatch.setitem(cpp._STATE, "paged_attention", "off for this test")
    before = paged.kernel_calls()
    out = m.generate(prompt, max_new_tokens=8, do_sample=False)
    after = paged.kernel_calls()
    infopt.undo(m)
    assert torch.equal(out, ref)
    assert after["cpu"] == before["cpu"] and after["reference"] > before["reference"]
