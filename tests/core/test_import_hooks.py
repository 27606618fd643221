import importlib
import sys

import pytest

from infopt.core.import_hooks import after_import


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n in sys.modules if n.startswith("infopt_hook_probe")]:
        del sys.modules[name]


def test_callback_runs_once_after_the_module_is_imported(module_dir):
    (module_dir / "infopt_hook_probe.py").write_text("VALUE = 1\n")
    seen = []
    after_import("infopt_hook_probe", lambda: seen.append(sys.modules["infopt_hook_probe"].VALUE))
    assert seen == []  # not imported by registering the callback
    mod = importlib.import_module("infopt_hook_probe")
    assert seen == [1]
    assert type(mod.__loader__).__name__ == "SourceFileLoader" and mod.__spec__.loader is mod.__loader__
    importlib.reload(mod)
    assert seen == [1]
    after_import("infopt_hook_probe", lambda: seen.append("now"))  # already imported: at once
    assert seen == [1, "now"]


def test_a_failing_callback_fails_the_import(module_dir):
    (module_dir / "infopt_hook_probe_bad.py").write_text("VALUE = 1\n")

    def boom():
        raise RuntimeError("registration failed")

    after_import("infopt_hook_probe_bad", boom)
    with pytest.raises(RuntimeError, match="registration failed"):
        importlib.import_module("infopt_hook_probe_bad")
