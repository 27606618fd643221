"""Docs that cannot go stale: every ```python block of README.md and docs/*.md runs (see tests/doc_blocks.py)."""

from __future__ import annotations

import contextlib
import os
import re
import traceback

import pytest

from .doc_blocks import ROOT, Block, python_blocks, run_block

BLOCKS = python_blocks()


class _Page:
    """One page's session: its namespace and how far its blocks have run."""

    def __init__(self, folder):
        self.folder = folder  # the working directory of the page's blocks
        self.namespace: dict = {}
        self.done: set[int] = set()
        self.failed: list[str] = []


_SESSIONS: dict[str, _Page] = {}


# blocks that compile, tune or export take 5 to 60 s on 2 cores: `slow` (make test runs them, make test-fast not),
# and so is every later block of the page, which would run them to catch up (_catch_up)
_SLOW = re.compile(r"\btune\(|cpu-fast|Compile\(|compile_\(|\"throughput\"|make_reference\(")


def _params():
    slow_pages = set()
    for block in BLOCKS:
        if _SLOW.search(block.code) and block.marker not in ("skip", "real_model"):
            slow_pages.add(block.page)
        marks = [pytest.mark.slow] if block.page in slow_pages else []
        if block.marker == "real_model":
            marks.append(pytest.mark.real_model)
        if block.marker == "skip" and block.marker_error is None:
            marks.append(pytest.mark.skip(reason=f"{block.id}: {block.options['reason']}"))
        yield pytest.param(block, id=block.id, marks=marks)


@contextlib.contextmanager
def _cwd(folder: str):
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def _catch_up(page: _Page, block: Block) -> None:
    """Run the page's earlier blocks that have not run yet (when a block is selected on its own)."""
    for earlier in BLOCKS:
        if earlier.page != block.page or earlier.line >= block.line or earlier.line in page.done:
            continue
        page.done.add(earlier.line)
        if earlier.marker in ("skip", "real_model") or earlier.marker_error:
            continue
        try:
            with _cwd(page.folder):
                run_block(earlier, page.namespace)
        except Exception:  # its own test reports it
            page.failed.append(earlier.id)


@pytest.mark.parametrize("block", list(_params()))
def test_doc_block(block: Block, tmp_path_factory):
    if block.marker_error:
        pytest.fail(f"{block.id}: {block.marker_error}", pytrace=False)
    if block.page not in _SESSIONS:
        _SESSIONS[block.page] = _Page(tmp_path_factory.mktemp(re.sub(r"\W", "-", block.page)))
    page = _SESSIONS[block.page]
    _catch_up(page, block)
    page.done.add(block.line)
    # a real_model block runs on a copy, so the blocks after it see the same namespace whether it ran or not
    namespace = dict(page.namespace) if block.marker == "real_model" else page.namespace
    earlier = list(page.failed)
    try:
        with _cwd(page.folder):
            run_block(block, namespace)
        return
    except Exception as err:
        if block.marker != "real_model":
            page.failed.append(block.id)
        message = f"{block.id} failed\n{_where(err, block)}{type(err).__name__}: {err}"
    if earlier:
        message += f"\n(earlier blocks of this page failed: {', '.join(earlier)})"
    pytest.fail(message, pytrace=False)


def _where(err: BaseException, block: Block) -> str:
    """The traceback lines inside the doc block (as page lines), then the innermost frame."""
    frames = traceback.extract_tb(err.__traceback__)
    code = block.code.splitlines()
    lines = [f"  {block.page}:L{block.line + f.lineno}: {code[f.lineno - 1].strip()}"
             for f in frames if f.filename == block.id and 0 < f.lineno <= len(code)]
    if frames and frames[-1].filename != block.id:
        lines.append(f"  {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}: {frames[-1].line}")
    return "\n".join(lines) + "\n" if lines else ""


def test_every_page_is_collected():
    """Each page with a python block is collected, and no fence is left unclosed (a silent non-block)."""
    pages = {b.page for b in BLOCKS}
    assert "README.md" in pages and "docs/getting-started.md" in pages
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        fences = [ln for ln in path.read_text().splitlines() if re.match(r"^\s*```", ln)]
        assert len(fences) % 2 == 0, f"{path.relative_to(ROOT)}: an unclosed ``` fence"


# -- listings in the docs, compared with the code they list ----------------------------------------------


def _api_all_lines():
    """``(module, names, line)`` for each "`__all__`: ..." paragraph of docs/api.md, under its heading."""
    lines = (ROOT / "docs/api.md").read_text().splitlines()
    module, found = None, []
    for i, line in enumerate(lines):
        if m := re.match(r"^#{2,4} .*?`(infopt(?:\.\w+)*)`", line):
            module = m[1]
        if line.startswith("`__all__`:"):
            para = [line]
            for nxt in lines[i + 1:]:
                if not nxt.strip() or nxt.startswith("#"):
                    break
                para.append(nxt)
            listing = " ".join(para).split(":", 1)[1].split(". ")[0]  # up to the sentence after the list
            found.append(pytest.param(module, re.findall(r"`([^`]+)`", listing), id=f"docs/api.md:L{i + 1}"))
    return found


@pytest.mark.parametrize(("module", "names"), _api_all_lines())
def test_api_lists_each_modules_all(module, names):
    import importlib

    public = importlib.import_module(module).__all__
    assert sorted(names) == sorted(public), (
        f"docs/api.md lists {module}.__all__ as {names}; the code has {public} "
        f"(missing: {sorted(set(public) - set(names))}, gone: {sorted(set(names) - set(public))})")


def _table(page: str, heading: str) -> list[list[str]]:
    """The rows of the first table under ``heading`` in ``page``, cells stripped of backticks."""
    text = (ROOT / page).read_text()
    section = text.split(heading, 1)[1].splitlines()
    start = next(i for i, ln in enumerate(section) if ln.startswith("|"))
    rows = []
    for ln in section[start:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip().strip("`") for c in ln.strip("|").split(" | ")])
    return rows[2:]  # header and --- separator


def test_recipes_presets_table_is_presets():
    from infopt.recipe import PRESETS

    table = _table("docs/recipes.md", "## Presets")
    rows = {r[0]: r[3] for r in table}
    assert list(rows) == list(PRESETS), "docs/recipes.md's presets table lists other presets than infopt.PRESETS"
    for name, description in rows.items():
        assert description == PRESETS[name].description, f"docs/recipes.md: {name}'s description differs"
    assert {r[0]: r[1] for r in table} == {n: p.fidelity for n, p in PRESETS.items()}, (
        "docs/recipes.md's presets table states another fidelity than Preset.fidelity")


def test_recipes_fidelity_table_is_every_steps_fidelity():
    from infopt.core.step import FIDELITY, STAGES, STEP_TYPES

    rows = _table("docs/recipes.md", "### What each step keeps")
    code = [(stage, kind or "-", cls.__name__, cls.fidelity) for stage in STAGES
            for kind, cls in STEP_TYPES.get(stage, {}).items()]
    # the registry's order is the order of imports: the table keeps its own, the rows must be the same
    assert sorted(tuple(r) for r in rows) == sorted(code), \
        "docs/recipes.md's fidelity table differs from the steps' fidelity"
    assert all(f in FIDELITY for *_, f in code)


def test_recipes_rules_table_is_rules():
    from infopt.recipe import RULES

    rows = _table("docs/recipes.md", "The table below lists `RULES` exactly")
    relation = [r.relation + (f" (unless `{r.unless}`)" if r.unless else "") for r in RULES]
    assert [tuple(r) for r in rows] == [(r.a, r.b, rel, r.reason, r.fix) for r, rel in zip(RULES, relation,
                                                                                            strict=True)], (
        "docs/recipes.md's rules table differs from infopt.recipe.RULES (order matters)")


def test_recipes_stage_table_lists_the_registered_kinds():
    from infopt.attention import BACKENDS
    from infopt.recipe import available_steps

    steps = available_steps()
    rows = _table("docs/recipes.md", "## Canonical stage order")
    assert [r[1] for r in rows] == list(steps), "docs/recipes.md's stage table is not infopt.core.step.STAGES"
    for _, stage, text in rows:
        listed = re.findall(r"`([^`]+)`", text.split("(", 1)[1]) if "(" in text else []
        kinds = list(BACKENDS) if stage == "attention" else [k for k in steps[stage] if k]
        if kinds:
            assert sorted(listed) == sorted(kinds), f"docs/recipes.md: stage {stage} lists {listed}, the code {kinds}"


def _field_default(cls, name):
    import dataclasses

    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return list(value) if isinstance(value, tuple) else value


def _step_sections():
    """``(stage, class path, rows, header)`` for the first table of each ``### `stage` — `infopt...` `` section of
    docs/recipes.md's Steps."""
    text = (ROOT / "docs/recipes.md").read_text()
    found = []
    for m in re.finditer(r"^### `(\w+)` — `([\w.]+)`$", text, flags=re.M):
        body = text[m.end():].split("\n### ", 1)[0]
        lines = [ln for ln in body.splitlines() if ln.startswith("|")]
        start = body.splitlines().index(lines[0])
        table = []
        for ln in body.splitlines()[start:]:
            if not ln.startswith("|"):
                break
            table.append([c.strip() for c in ln.strip("|").split(" | ")])
        found.append(pytest.param(m[1], m[2], table[2:], table[0], id=m[1]))
    return found


@pytest.mark.parametrize(("stage", "where", "rows", "header"), _step_sections())
def test_recipes_field_tables_are_the_dataclasses(stage, where, rows, header):
    """Each step's field table in docs/recipes.md lists the config's fields, in order, with their defaults (what
    ``infopt recipes --fields`` prints)."""
    import dataclasses
    import importlib

    import yaml

    from infopt.core.step import STEP_TYPES

    def doc_value(cell):
        return yaml.safe_load(cell.strip("`"))

    if header[0] == "field":  # one config: | field | type | default | allowed |
        module, _, name = where.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        assert cls is STEP_TYPES[stage][None]
        tables = {None: (cls, [(r[0].strip("`"), doc_value(r[2])) for r in rows])}
    else:  # one row per kind: | `method` | config | fields (defaults) | ...
        tables = {}
        for r in rows:
            kind, config = r[0].strip("`"), r[1].strip("`")
            assert kind in STEP_TYPES[stage], f"docs/recipes.md: {stage} has no kind {kind!r}"
            cls = STEP_TYPES[stage][kind]
            assert config == cls.__name__, f"docs/recipes.md: {stage}:{kind} is {cls.__name__}, the table says {config}"
            listed = re.findall(r"`(\w+)` \(`([^`]*)`", r[2])
            tables[kind] = (cls, [(n, yaml.safe_load(v)) for n, v in listed])
        missing = sorted(set(STEP_TYPES[stage]) - set(tables))
        assert not missing, f"docs/recipes.md: the {stage} table has no row for {missing}"
    for kind, (cls, listed) in tables.items():
        key = f"{stage}:{kind}" if kind else stage
        names = [f.name for f in dataclasses.fields(cls)]
        assert [n for n, _ in listed] == names, (
            f"docs/recipes.md lists {key}'s fields as {[n for n, _ in listed]}; {cls.__name__} has {names} "
            f"(`infopt recipes --fields {key}`)")
        for name, shown in listed:
            assert shown == _field_default(cls, name), (
                f"docs/recipes.md: {key}.{name} defaults to {_field_default(cls, name)!r}, the table says {shown!r}")


# -- the collector itself ------------------------------------------------------------------------------

_SAMPLE = '''# Sample

<!-- test: tiny -->
```python
x = 2
print(x * 21)
```

prints:

```
42
```

Sizes vary; for example:

```python
print("weights 513.1 -> 401.1 MiB")
```

```text
weights 12.3 -> 15.4 MiB
```

<!-- test: skip -->
```python
raise SystemExit
```

<!-- test: fast -->
```python
pass
```

```python
print("random")
```

An example run printed:

```
whatever it printed that day
```

```python
y = 1
```

Some prose, not a lead-in.

```
not an output: the paragraph between does not end with a colon
```
'''


def test_parse_markers_and_outputs(tmp_path):
    from .doc_blocks import parse_page

    page = tmp_path / "sample.md"
    page.write_text(_SAMPLE)
    blocks = [b for b in parse_page(page) if b.lang == "python"]
    first, vary, skip, unknown, run, prose = blocks
    assert first.id == "sample.md:L4" and first.marker == "tiny" and first.output == "42\n"
    assert not first.numbers_vary and vary.numbers_vary and vary.output.startswith("weights 12.3")
    assert "must say why" in skip.marker_error and "must name one of" in unknown.marker_error
    assert run.example_run and run.output.startswith("whatever") and prose.output is None


def test_run_block_compares_what_the_doc_shows(tmp_path):
    from .doc_blocks import DocValueError, parse_page

    page = tmp_path / "sample.md"
    page.write_text(_SAMPLE)
    first, vary, _, _, run, _ = [b for b in parse_page(page) if b.lang == "python"]
    ns = {}
    for block in (first, vary, run):  # 42 == 42; numbers as wildcards; an example run is not compared
        run_block(block, ns)
    first.output = "41\n"
    with pytest.raises(AssertionError, match="but the doc shows"):
        run_block(first, ns)
    first.code, first.output = "1 + 1  # 3\nprint(2)  # 2\nlen('abc')  # three letters\n", None
    with pytest.raises(DocValueError, match=r"`1 \+ 1` gives\s+2\s+but the doc shows\s+3"):
        run_block(first, ns)
    first.code = "print(2)  # 2: the answer\nlen('abc')  # three letters\n[1, 2]  # [1, ...]\n"
    run_block(first, ns)


def test_loading_a_model_needs_a_marker(tmp_path):
    from .doc_blocks import Block

    block = Block("sample.md", 1, "python", "from infopt.models import load_default\nmodel, tok = load_default()\n")
    with pytest.raises(RuntimeError, match="test: tiny"):
        run_block(block, {})
    block.marker = "tiny"
    ns = {}
    run_block(block, ns)
    assert ns["model"].config.num_hidden_layers == 2 and ns["tok"].vocab_size == 49152
