"""infopt's floors hold by contract: import-linter's contracts (``.importlinter``) pass on the package, a planted
upward import, import loop, import of the package itself or module on no floor breaks them, and an import inside a
function is there because it loads something ``import infopt`` does not (an optional backend, an import-time cost).

``make lint`` runs the same contracts with ``lint-imports``; this file makes CI run them (``make test``).
"""

from __future__ import annotations

import ast
import configparser
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# the dev extra (CI installs it); a machine without it, such as the GPU lane's, skips the module with the reason
pytest.importorskip("importlinter", reason="import-linter is not installed: pip install -e '.[dev]'")

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
CONFIG = ROOT / ".importlinter"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _read(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    parser.read(path)
    return parser


_NAMES = {section.rpartition(":")[2]: body["name"] for section, body in _read(CONFIG).items() if ":contract:" in section}
FLOORS, ACYCLIC, FACADE = _NAMES["floors"], _NAMES["acyclic"], _NAMES["facade"]


def _lint(*, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    """``lint-imports`` with the project's contracts, on the installed package or on the copy under ``pythonpath``."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), *filter(None, [env.get("PYTHONPATH")])])
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--config", str(CONFIG), "--no-cache"], capture_output=True,
                          text=True, env=env, cwd=pythonpath or ROOT)


def _broken(out: str) -> set[str]:
    """The names of the contracts lint-imports reports broken (it wraps long names: joined back)."""
    flat = " ".join(out.split())
    status = {name: re.search(re.escape(name) + r" (KEPT|BROKEN)\b", flat) for name in _NAMES.values()}
    assert all(status.values()), f"a contract's status is missing from the output: {status}"
    return {name for name, m in status.items() if m[1] == "BROKEN"}


def test_the_contracts_hold():
    res = _lint()
    assert res.returncode == 0 and "0 broken" in res.stdout, res.stdout + res.stderr
    assert "3 kept" in res.stdout, res.stdout  # the three contracts of .importlinter ran


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory) -> Path:
    """A copy of src/infopt (sources only) to plant imports in; lint-imports finds it first on PYTHONPATH."""
    root = tmp_path_factory.mktemp("copy")
    shutil.copytree(SRC / "infopt", root / "infopt", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    return root


PLANTED = {
    # an upward import inside a function: import-linter sees imports in functions too (nothing under optimize
    # imports memory, so this one makes no loop: the floors alone catch it)
    "upward-in-a-function": ({"infopt/memory/planted.py": "def f():\n    from ..optimize import optimize\n"},
                             {FLOORS}, "infopt.memory.planted -> infopt.optimize"),
    # an upward import from the ground floor, which every package imports: a loop as well
    "upward-from-core": ({"infopt/core/planted.py": "from ..kvcache import Static\n"},
                         {FLOORS, ACYCLIC}, "infopt.core.planted -> infopt.kvcache"),
    # two modules of one package importing each other
    "loop-in-a-package": ({"infopt/generate/planted_a.py": "from . import planted_b\n",
                           "infopt/generate/planted_b.py": "def f():\n    from . import planted_a\n"},
                          {ACYCLIC}, "infopt.generate"),
    # the version from the package, as compile/saved.py once took it: a loop through infopt/__init__.py
    "the-package-itself": ({"infopt/compile/planted.py": "def f():\n    from .. import __version__\n"},
                           {FACADE, FLOORS}, "infopt.compile.planted -> infopt"),
    # a new module under infopt/ that no floor lists
    "a-module-on-no-floor": ({"infopt/planted.py": "X = 1\n"}, {FLOORS}, "infopt.planted"),
}


def test_the_copy_passes_unchanged(package_copy):
    """The planted runs below fail because of what is planted, not because the copy is found or read differently."""
    res = _lint(pythonpath=package_copy)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("case", list(PLANTED))
def test_a_planted_violation_breaks_its_contract(package_copy, case):
    files, contracts, shown = PLANTED[case]
    for rel, text in files.items():
        (package_copy / rel).write_text(text)
    try:
        res = _lint(pythonpath=package_copy)
    finally:
        for rel in files:
            (package_copy / rel).unlink()
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert _broken(out) == contracts, out
    assert shown in out, out


# -- imports inside functions ---------------------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _guarded(tree: ast.AST) -> set[int]:
    """Line numbers of the imports in a ``try:`` whose ``except`` catches ImportError: optional by construction."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                h.type is not None and {"ImportError", "ModuleNotFoundError"} & {n.id for n in ast.walk(h.type)
                                                                                if isinstance(n, ast.Name)}
                for h in node.handlers):
            lines |= {n.lineno for stmt in node.body for n in ast.walk(stmt) if isinstance(n, (ast.Import,
                                                                                                ast.ImportFrom))}
    return lines


def imports_in_functions() -> list[tuple[str, int, str, bool]]:
    """``(file, line, statement, guarded)`` for each import statement inside a function of src/infopt, relative
    imports written out absolutely (``from infopt.eval import x``); ``guarded``: inside ``try: ... except
    ImportError``."""
    out = []
    for path in sorted((SRC / "infopt").rglob("*.py")):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        guarded = _guarded(tree)
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                line = node.lineno
                if isinstance(node, ast.ImportFrom) and node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    node = ast.ImportFrom(module=".".join(base + ([node.module] if node.module else [])),
                                          names=node.names, level=0)
                out.append((str(path.relative_to(ROOT)), line, ast.unparse(node), line in guarded))
    return sorted(set(out))  # (a function nested in a function is walked twice)


# Run after ``import infopt``: for each statement, the modules it would load that are not loaded yet (without running
# it: a name transformers resolves lazily counts as loaded when the module it lives in is).
_PROBE = r"""
import ast, json, sys
import infopt

def lazy_target(mod, name):
    sub = getattr(mod, "_class_to_module", {}).get(name)  # transformers' lazy modules
    return f"{mod.__name__}.{sub}" if sub else None

def new_modules(statement):
    node = ast.parse(statement).body[0]
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name not in sys.modules]
    if node.module not in sys.modules:
        return [node.module]
    new = []
    for a in node.names:
        mod, name = sys.modules[node.module], a.name
        while name not in vars(mod) and f"{mod.__name__}.{name}" not in sys.modules:
            target = lazy_target(mod, name)
            if target is None or target not in sys.modules:
                new.append(target or f"{mod.__name__}.{name}")
                break
            mod = sys.modules[target]
    return new

print(json.dumps([new_modules(s) for s in json.loads(sys.stdin.read())]))
"""


@pytest.fixture(scope="module")
def function_imports() -> list[tuple[str, int, str, bool, list[str]]]:
    """Each import inside a function (:func:`imports_in_functions`) with the modules it loads that ``import infopt``
    has not."""
    found = imports_in_functions()
    res = subprocess.run([sys.executable, "-c", _PROBE], input=json.dumps([s for _, _, s, _ in found]),
                         capture_output=True, text=True, check=True)
    return [(*f, new) for f, new in zip(found, json.loads(res.stdout.strip().splitlines()[-1]), strict=True)]


def test_imports_inside_functions_load_something(function_imports):
    """DESIGN: imports inside functions only for optional backends (and what is slow to import). One whose modules
    ``import infopt`` has loaded already hides a dependency from the reader and buys nothing: import it at the top.
    (One guarded by ``except ImportError`` is optional by construction.)"""
    idle = [f"{f}:{line}: {s}" for f, line, s, guarded, new in function_imports if not new and not guarded]
    assert not idle, "imports inside functions that load nothing new (move them to the top of the module):\n" + \
        "\n".join(idle)


def _key(module: str) -> str:
    """How docs/architecture.md names what an import inside a function loads: an infopt module as far down as
    ``import infopt`` leaves it unloaded, anything else by its top-level package."""
    return module if module.startswith("infopt.") else module.partition(".")[0]


def _documented() -> dict[str, str]:
    """``{key: reason}`` from the table in docs/architecture.md's "Imports inside functions"."""
    text = ARCHITECTURE.read_text().split("### Imports inside functions", 1)[1]
    rows = [ln for ln in text.splitlines() if ln.startswith("| `")]
    out = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        for key in re.findall(r"`([^`]+)`", cells[0]):
            out[key] = cells[1]
    return out


def test_docs_list_what_imports_inside_functions_load(function_imports):
    """docs/architecture.md's table names every module loaded from inside a function, and nothing else."""
    loaded = {}
    for f, line, _, _, new in function_imports:
        for m in new:
            loaded.setdefault(_key(m), []).append(f"{f}:{line}")
    documented = _documented()
    missing = {k: v[:3] for k, v in loaded.items() if not any(k == d or k.startswith(d + ".") for d in documented)}
    stale = sorted(d for d in documented if not any(k == d or k.startswith(d + ".") for k in loaded))
    assert not missing, f"imported inside functions but not in {ARCHITECTURE.name}'s table (add a row, with why): " \
        f"{missing}"
    assert not stale, f"{ARCHITECTURE.name}'s table lists modules no function imports any more: {stale}"


def test_the_module_map_lists_packages_above_what_they_import():
    """docs/index.md's "Module map" says imports only point down its rows: no row imports a row above it."""
    import grimp

    lines = (ROOT / "docs" / "index.md").read_text().split("## Module map", 1)[1].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    table = [ln for ln in itertools.takewhile(lambda ln: ln.startswith("|"), lines[start:])][2:]
    rows = [re.findall(r"`(infopt(?:\.\w+)+)`", ln.split(" | ")[0]) for ln in table]
    assert len(rows) > 10 and all(rows), rows
    graph = grimp.build_graph("infopt", cache_dir=None)
    layers = [grimp.Layer(*row, independent=False) for row in rows]
    upward = graph.find_illegal_dependencies_for_layers(layers=layers)
    assert not upward, "docs/index.md's module map lists a package above one that imports it: " + ", ".join(
        sorted(f"{d.importer} -> {d.imported}" for d in upward))
