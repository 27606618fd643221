"""Every ``>>>`` example in infopt's docstrings runs (STYLE: each public function has a short runnable example)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import infopt

_FOUND = [m for m in pkgutil.walk_packages(infopt.__path__, "infopt.") if not m.name.endswith("__main__")]
MODULES = sorted(m.name for m in _FOUND)
PACKAGES = {m.name for m in _FOUND if m.ispkg}  # their __init__ re-exports names whose examples run where defined

WITHOUT_EXAMPLES = {
    # modules with no ``>>>`` example of their own: a version string, pytest hooks, and machinery whose behaviour is
    # asserted by its own tests (not a STYLE exemption: adding an example means removing the name here)
    "infopt._version", "infopt.attention.registry", "infopt.batching.core",
    "infopt.compile.aot", "infopt.compile.packed_step", "infopt.compile.passes", "infopt.compile.saved", "infopt.demo",
    "infopt.generate.lean", "infopt.parallel.layers", "infopt.quantize.community.gguf_ckpt",
    "infopt.quantize.community.gptq_ckpt", "infopt.speculative.drafters", "infopt.speculative.loop",
    "infopt.testing.plugin",
    # every example marked ``+SKIP``: it needs the real default model, which the unit tier does not load
    "infopt.bench.workloads",
}


def _command_line(name: str) -> bool:
    """Command-line modules (argument parsing and printing, run by the CLI tests) may go without examples."""
    return name == "infopt.cli" or name.startswith("infopt.cli.") or name.endswith(".cli")


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
    # a runner that finds no example passes vacuously: a module with examples must have had them run
    if name in WITHOUT_EXAMPLES:
        assert result.attempted == 0, f"{name} has examples now: drop it from WITHOUT_EXAMPLES"
    elif name not in PACKAGES and not _command_line(name):
        assert result.attempted > 0, (f"no docstring example ran in {name}: give its public functions an Example "
                                      "(STYLE), or list it in WITHOUT_EXAMPLES with the reason")


def test_without_examples_names_existing_modules():
    assert WITHOUT_EXAMPLES <= set(MODULES), sorted(WITHOUT_EXAMPLES - set(MODULES))
