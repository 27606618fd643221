"""Every ``>>>`` example in infopt's docstrings runs (STYLE: each public function has a short runnable example)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import infopt

MODULES = sorted(m.name for m in pkgutil.walk_packages(infopt.__path__, "infopt.")
                 if not m.name.endswith("__main__"))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = [t for t in finder.find(module, name) if t.examples]
    for t in tests:
        runner.run(t)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples failed in {name} (output above)"
