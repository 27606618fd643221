"""Figures quoted in the docs, tied to the results files they come from (used by tests/test_doc_figures.py).

A measured figure in a page's prose or tables is followed by an HTML comment naming its source::

    1.42x <!-- fig: decode-vs-llamacpp-avx512-epyc-aot.json median_ratio_q4_1 %.2fx -->

- the file, relative to ``benchmarks/results/`` (written by a script in ``benchmarks/`` or by ``infopt bench``);
- the value: a dotted path into the JSON (list items by index: ``rounds.0.model_mib``); ``median(...)``, ``min(...)``
  or ``max(...)`` of a path with ``*`` standing for every item of a list (``median(rounds.*.llama_q4_1)``); or
  ``A/B``, two such values divided (a ratio the file does not store itself);
- the format: printf-style (``%.2fx``, ``%.1f MiB``) or ``str.format``-style (``{:,.0f} ms``, ``{:.0%}``).

The text just before the comment (or, for a comment opening a line, the line above), with trailing spaces and
``*``/``_``/`` ` `` marks stripped, must end with the formatted value (and not in the middle of a longer number). A figure that no results file holds is marked
``<!-- fig: - WHY -->``: WHY says where it comes from (computed from the model's config, the size of a shipped file,
a one-off measurement kept in no file), and the sentence around it must say so in words too.

In :data:`FIGURE_PAGES`, every figure of a measured shape (a ratio ``7.72x``, ``97.4 MiB``, ``172.4 tokens/s``,
``44 ms``, ``KL 0.0051``, ``top-1 0.969``) must carry one of the two comments, except inside code blocks shown as
example output (a bare or ``text`` block whose lead-in says "example run" or "for example", or the printed output
of a python block). ``docs/performance.md`` is held to that up to its first ``###`` heading (its summary); its dated
sections below keep their figures as history and may carry markers, which are then checked like any other.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from .doc_blocks import ROOT, pages, parse_page

RESULTS = ROOT / "benchmarks" / "results"
FIGURE_PAGES = {  # page -> the heading prefix its held part ends at (None: the whole page)
    "README.md": None,
    "docs/index.md": None,
    "docs/getting-started.md": None,
    "docs/performance.md": "### ",
}

_MARKER = re.compile(r"<!--\s*fig:(?P<body>.*?)-->")
_FUNC = re.compile(r"^(?P<fn>median|min|max)\((?P<path>[^()]+)\)$")
_FUNCS = {"median": statistics.median, "min": min, "max": max}
_FENCE = re.compile(r"^\s*(`{3,})(?P<lang>[\w+-]*)\s*$")
_TRAILING_MARKS = " \t*_`"
_NUMBER = re.compile(r"(?<![\w.,-])\d[\d,]*(?:\.\d+)?(?![\w.,]?\d)(?!-\w)")  # not in a date or "2-core"
_MEASURED_ROW = re.compile(r"tokens/s|tok/s|MiB|\bMB\b|GB/s|\bms\b|\bKL\b|top-1|time to first token|TTFT", re.I)
# figures of a measured shape: a ratio, a size, a rate, a time in ms, a KL or top-1 value
FIGURE = re.compile(
    r"(?<![\w.,])\d[\d,]*(?:\.\d+)?(?:x(?!\w)| ?(?:MiB|MB|GiB|GB/s|GB)\b| (?:tokens|tok)/s\b| ?ms\b)"
    r"|\b(?:KL|top-1(?: agreement)?)(?: of| was| is)? \d*\.\d+"
)


@dataclass
class Marker:
    """One ``<!-- fig: ... -->`` comment of a page."""

    page: str
    line: int
    before: str  # the text of the line before the comment
    body: str
    in_code: bool = False  # inside a fenced block, where the comment would be shown

    @property
    def id(self) -> str:
        return f"{self.page}:L{self.line}"

    @property
    def unbacked(self) -> bool:
        return self.body.startswith("-")


class FigureError(AssertionError):
    pass


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def _code_lines(lines: list[str]) -> set[int]:
    """0-based indexes of the lines inside fenced blocks, fences included."""
    inside, fence = set(), None
    for i, line in enumerate(lines):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            inside.add(i)
        elif fence is not None:
            inside.add(i)
            if line.strip() == fence:
                fence = None
    return inside


def markers(path: Path) -> list[Marker]:
    """Every figure comment of a page, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    code = _code_lines(lines)
    found = []
    for i, line in enumerate(lines):
        spans = [c.span() for c in re.finditer(r"`[^`]*`", line)]  # a comment shown as inline code is no marker
        for m in _MARKER.finditer(line):
            if any(a < m.start() < b for a, b in spans):
                continue
            before = line[:m.start()]
            if not before.strip() and i > 0:  # a comment opening a line follows the figure ending the line above
                before = lines[i - 1]
            found.append(Marker(_rel(path), i + 1, before, m["body"].strip(), i in code))
    return found


def all_markers() -> list[Marker]:
    return [m for p in pages() for m in markers(p)]


# -- values ---------------------------------------------------------------------------------------------------


def _lookup(data, path: str) -> list:
    """The values at a dotted path, ``*`` expanding every item of a list (or mapping)."""
    values = [data]
    for part in path.split("."):
        nxt = []
        for v in values:
            if part == "*":
                nxt.extend(v.values() if isinstance(v, dict) else v)
            elif isinstance(v, list):
                if not re.fullmatch(r"-?\d+", part) or not -len(v) <= int(part) < len(v):
                    raise FigureError(f"'{part}' of '{path}' is not an index of a list of {len(v)}")
                nxt.append(v[int(part)])
            elif isinstance(v, dict):
                if part not in v:
                    raise FigureError(f"'{path}': no key '{part}' (keys: {', '.join(map(str, v))})")
                nxt.append(v[part])
            else:
                raise FigureError(f"'{path}': '{part}' goes below a value ({v!r})")
        values = nxt
    return values


def _number(v, expr: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise FigureError(f"'{expr}' is {v!r}, not a number")
    return float(v)


def value(data, expr: str) -> float:
    """The number an expression names in a results file's data."""
    if "/" in expr:
        num, den = expr.split("/", 1)
        return value(data, num) / value(data, den)
    if m := _FUNC.match(expr):
        values = [_number(v, expr) for v in _lookup(data, m["path"])]
        if not values:
            raise FigureError(f"'{expr}': no values")
        return float(_FUNCS[m["fn"]](values))
    if "*" in expr:
        raise FigureError(f"'{expr}' names several values: wrap it in median(), min() or max()")
    (v,) = _lookup(data, expr)
    return _number(v, expr)


def render(number: float, fmt: str) -> str:
    return fmt.format(number) if "{" in fmt else fmt % number


def expected(marker: Marker, results: Path = RESULTS) -> str:
    """What the text before a backed marker must end with."""
    parts = marker.body.split(None, 2)
    if len(parts) < 3:
        raise FigureError(f"{marker.id}: <!-- fig: {marker.body} --> needs FILE VALUE FORMAT, e.g. "
                          "<!-- fig: decode-cpu-fast.json ratios.decode_tokens_per_s %.2fx -->")
    file, expr, fmt = parts
    path = results / file
    if not path.is_file():
        raise FigureError(f"{marker.id}: no results file {_rel(path)}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return render(value(data, expr), fmt)
    except FigureError as e:
        raise FigureError(f"{marker.id}: {file}: {e}") from None


def check(marker: Marker, results: Path = RESULTS) -> None:
    """Raise FigureError unless the marker is well formed and the figure before it is its file's value."""
    if marker.in_code:
        raise FigureError(f"{marker.id}: a figure comment inside a code block is shown as text; put it in prose or "
                          "a table, or mark the block as example output")
    if marker.unbacked:
        if not marker.body.lstrip("- ").strip():
            raise FigureError(f"{marker.id}: <!-- fig: - WHY --> must say where the figure comes from")
        if not FIGURE.search(marker.before) and not re.search(r"\d\s*$", marker.before.rstrip(_TRAILING_MARKS)):
            raise FigureError(f"{marker.id}: <!-- fig: - ... --> follows no figure")
        return
    want = expected(marker, results)
    text = marker.before.rstrip(_TRAILING_MARKS)
    at = len(text) - len(want)
    if not text.endswith(want) or (at > 0 and (text[at - 1].isalnum() or text[at - 1] in "._")):
        shown = text[-max(len(want) + 12, 24):]
        raise FigureError(f"{marker.id}: the file gives {want!r} ({marker.body}), but the page shows "
                          f"...{shown!r} before the comment")


# -- figures left unmarked ------------------------------------------------------------------------------------


def _example_blocks(path: Path) -> set[int]:
    """1-based opening lines of the page's blocks shown as example output."""
    lines = path.read_text(encoding="utf-8").splitlines()
    starts = set()
    for block in parse_page(path):
        if block.lang == "python" and block.output_line and (block.example_run or block.numbers_vary):
            starts.add(block.output_line)
        if block.lang in ("", "text", "output"):
            lead = " ".join(_lead(lines, block.line - 1).lower().split())
            if "example run" in lead or "for example" in lead:
                starts.add(block.line)
    return starts


def _lead(lines: list[str], fence: int) -> str:
    """The paragraph just above the fence at 0-based line ``fence``."""
    j = fence - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    para = []
    while j >= 0 and lines[j].strip() and not _FENCE.match(lines[j]):
        para.append(lines[j])
        j -= 1
    return "\n".join(reversed(para))


def unmarked(path: Path, stop: str | None = None) -> list[str]:
    """``page:Lline: figure`` for each figure of a measured shape that no comment follows."""
    rel = _rel(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    examples = _example_blocks(path)
    scanned_langs = ("", "text", "output")
    missing, fence, skip = [], None, False
    for i, line in enumerate(lines, 1):
        if fence is None and stop and line.startswith(stop):
            break
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            skip = m["lang"].lower() not in scanned_langs or i in examples
            continue
        if fence is not None:
            if line.strip() == fence:
                fence = None
                continue
            if skip:
                continue
        for f in _figures(line):
            rest = line[f.end():].lstrip(_TRAILING_MARKS)
            if not rest and i < len(lines):  # the comment may open the next line
                rest = lines[i].lstrip()
            if not _MARKER.match(rest):
                missing.append(f"{rel}:L{i}: {f[0]}")
    return missing


def _figures(line: str) -> list[re.Match]:
    """The figures of a line: measured shapes anywhere, and every number of a table row whose first cell names a
    measured quantity (``| decode tokens/s | 16.0 | 172.4 |``)."""
    found = {f.start(): f for f in FIGURE.finditer(line)}
    cells = line.strip().strip("|").split("|") if line.lstrip().startswith("|") else []
    if cells and _MEASURED_ROW.search(cells[0]):
        first = line.index("|", line.index("|") + 1)  # the end of the first cell
        for f in _NUMBER.finditer(line, first):
            if not any(g.start() <= f.start() < g.end() for g in found.values()):
                found[f.start()] = f
    return [found[k] for k in sorted(found)]
