"""Runs the ```python blocks of the markdown docs: parsing, markers, output checks (used by tests/test_docs.py).

A page is one session, like a doctest file: its blocks run in order in one namespace.

Markers sit in an HTML comment just above a block (blank lines between are allowed)::

    <!-- test: tiny -->                              every model the block loads is a tiny one
    <!-- test: real_model -->                        run with the embedded default model (real_model mark)
    <!-- test: skip reason="needs a CUDA device" -->  not run; the reason is reported by pytest

``tiny``: while the block runs, ``infopt.models.load_default()`` and ``infopt.models.load_model(path)``
return ``tiny_model("llama", max_positions=2048)`` (2 layers, the default tokenizer's vocabulary 49,152)
and the default model's tokenizer, so a block written for SmolLM2-135M runs in a second. A block that
calls ``load_default``/``load_model`` without ``tiny`` or ``real_model`` fails and says to add one.

``real_model`` blocks run on a copy of the page's namespace, so deselecting them (``-m "not real_model"``)
leaves the following blocks as they were.

What a block shows as its result is checked:

- ``>>>`` blocks run as doctests (ELLIPSIS, NORMALIZE_WHITESPACE).
- ``expr  # value``: a bare expression whose trailing comment is itself a Python expression (``# True``,
  ``# ['attention', 'kvcache:static']``, ``# 0.0030...``), or starts with one followed by ": why"
  (``# 8: two blocks reused``), is compared with ``repr(expr)``; for ``print(x)  # value``, with what
  it prints. A comment that starts with "e.g." or "for example" is an illustration and is not
  compared, nor is prose (a comment that does not parse, or names with no literal: ``# sdpa``).
- A ```text (or bare ```) block right after a python block (with at most one lead-in paragraph ending
  in ":" between them) is what the block prints, compared line by line with whitespace collapsed.

Where the lead-in text says "for example" (or "e.g."), every number is compared as "some number": the
words, names and layout must match, the figures may differ. An output block whose lead-in says it is
an "example run" (one run of the real model, say: "An example run on the 2-core machine printed:") is
shown as it was printed and not compared; the block above it still runs.

Blocks run with a temporary folder of the page's own as the working directory, so files they write
stay out of the repository, and connections off the machine are refused: the examples download nothing.
"""

from __future__ import annotations

import ast
import contextlib
import doctest
import functools
import io
import re
import shlex
import socket
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/*.md")
MARKERS = ("tiny", "real_model", "skip")
EXAMPLE_WORDS = ("for example", "e.g.")  # the figures shown are an example: numbers compared as any number
EXAMPLE_RUN = "example run"  # the output shown is one run's, kept as it was printed: not compared

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,})(?P<lang>[\w+-]*)[ \t]*$")
_MARKER = re.compile(r"^\s*<!--\s*test:(?P<body>.*?)-->\s*$")
_NUMBER = re.compile(r"(?<![A-Za-z_\d.])[-+]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")
_LITERAL = re.compile(r"[\d'\"\[\]{}]|\b(?:True|False|None)\b")
_LOCAL_HOSTS = ("127.0.0.1", "::1", "localhost")
_LOADERS = re.compile(r"\bload_default\s*\(|\bload_model\s*\(")


@dataclass
class Block:
    """One fenced block of a page."""

    page: str  # path relative to the repo root, "docs/quantize.md"
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None = None  # tiny | real_model | skip
    options: dict[str, str] = field(default_factory=dict)
    marker_error: str | None = None
    output: str | None = None  # the text block shown as this block's printed output
    output_line: int | None = None
    numbers_vary: bool = False  # the doc says the figures are an example
    example_run: bool = False  # the doc says the output is one run's (of the real model, say): not compared

    @property
    def id(self) -> str:
        return f"{self.page}:L{self.line}"

    @property
    def is_doctest(self) -> bool:
        return self.code.lstrip().startswith(">>>")


def pages() -> list[Path]:
    found = []
    for pattern in PAGES:
        found.extend(sorted(ROOT.glob(pattern)))
    return found


def _parse_marker(text: str) -> tuple[str | None, dict[str, str], str | None]:
    try:
        words = shlex.split(text)
    except ValueError as err:
        return None, {}, f"unreadable marker <!-- test:{text}-->: {err}"
    names = [w for w in words if "=" not in w]
    options = dict(w.split("=", 1) for w in words if "=" in w)
    if len(names) != 1 or names[0] not in MARKERS:
        return None, options, (f"marker <!-- test:{text}--> must name one of {', '.join(MARKERS)}, "
                               f'e.g. <!-- test: skip reason="needs a CUDA device" -->')
    name = names[0]
    allowed = {"skip": {"reason"}}.get(name, set())
    if set(options) - allowed:
        return name, options, f"marker '{name}' takes no option(s) {', '.join(sorted(set(options) - allowed))}"
    if name == "skip" and not options.get("reason", "").strip():
        return name, options, 'a skipped block must say why: <!-- test: skip reason="..." -->'
    return name, options, None


def parse_page(path: Path) -> list[Block]:
    """Every fenced block of a markdown page, with its marker and the output block that follows it."""
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    between: list[str] = []  # the text since the last fence closed
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            between.append(lines[i])
            i += 1
            continue
        indent, ticks, lang = m["indent"], m["ticks"], m["lang"].lower()
        body, j = [], i + 1
        while j < len(lines) and not re.match(rf"^[ \t]*{ticks}[ \t]*$", lines[j]):
            line = lines[j]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            j += 1
        block = Block(rel, i + 1, lang, "\n".join(body) + "\n")
        marker_lines = [t for t in between if t.strip()]
        if marker_lines and (mm := _MARKER.match(marker_lines[-1])):
            block.marker, block.options, block.marker_error = _parse_marker(mm["body"])
        prev = blocks[-1] if blocks else None
        if prev is not None and prev.lang == "python" and lang in ("", "text", "output"):
            lead = "\n".join(between).strip()
            if not lead or ("\n\n" not in lead and lead.endswith(":")):
                prev.output, prev.output_line = block.code, block.line
                prev.numbers_vary = prev.numbers_vary or _says_example(lead)
                prev.example_run = EXAMPLE_RUN in " ".join(lead.lower().split())
        if lang == "python":
            lead = _last_paragraph(between)
            block.numbers_vary = lead.endswith(":") and _says_example(lead)
        blocks.append(block)
        between = []
        i = j + 1
    return blocks


def python_blocks() -> list[Block]:
    return [b for p in pages() for b in parse_page(p) if b.lang == "python"]


def _last_paragraph(lines: list[str]) -> str:
    text = "\n".join(t for t in lines if not _MARKER.match(t)).strip()
    return text.split("\n\n")[-1] if text else ""


def _says_example(text: str) -> bool:
    low = " ".join(text.lower().split())
    return any(w in low for w in EXAMPLE_WORDS)


# -- comparing ------------------------------------------------------------------------------------


def normalize(text: str, *, numbers: bool) -> str:
    """Collapse whitespace (and numbers to '#', when the figures are an example) for comparison."""
    lines = [" ".join(line.split()) for line in text.strip().splitlines()]
    out = "\n".join(line for line in lines if line)
    return _NUMBER.sub("#", out) if numbers else out


class _Checker(doctest.OutputChecker):
    """doctest's checker, with every number a wildcard when the doc says its figures are an example."""

    def __init__(self, numbers: bool):
        self.numbers = numbers

    def check_output(self, want, got, optionflags):
        if self.numbers:
            want, got = _NUMBER.sub("0", want), _NUMBER.sub("0", got)
        return super().check_output(want, got, optionflags)


_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _expected_comment(comment: str) -> str | None:
    """The value a trailing ``# comment`` shows, or None for prose and illustrations."""
    text = comment.lstrip("#").strip()
    if not text or text.lower().startswith(("e.g.", "for example", "example")):
        return None
    for value in (text, text.split(": ", 1)[0]):  # "value" or "value: why"
        try:
            ast.parse(value.replace("...", "0"), mode="eval")
        except SyntaxError:
            continue
        if _LITERAL.search(value.replace("...", "")):  # names alone ("sdpa", "a, b, ...") are prose
            return value
    return None


class DocValueError(AssertionError):
    pass


def _check_value(value, expected: str, where: str, source: str) -> None:
    got = repr(value)
    _compare(got, expected, where, source)


def _check_print(*args, expected: str, where: str, source: str, **kwargs) -> None:
    """``print(x)  # value``: the comment shows what is printed."""
    print(*args, **kwargs)
    _compare(kwargs.get("sep", " ").join(map(str, args)), expected, where, source)


def _compare(got: str, expected: str, where: str, source: str) -> None:
    if not _Checker(numbers=False).check_output(expected + "\n", got + "\n", _FLAGS):
        raise DocValueError(f"{where}: `{source}` gives\n    {got}\nbut the doc shows\n    {expected}")


def _instrument(code: str, block: Block) -> ast.Module:
    """The block's AST, each ``expr  # value`` statement replaced by a check of ``repr(expr)``."""
    tree = ast.parse(code, filename=block.id)
    comments = {}
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string
    lines = code.splitlines()

    class Rewrite(ast.NodeTransformer):
        def visit_Expr(self, node):
            expected = _expected_comment(comments.get(node.end_lineno, ""))
            if expected is None:
                return node
            where = f"{block.page}:L{block.line + node.end_lineno}"
            source = ast.get_source_segment(code, node.value) or lines[node.lineno - 1].strip()
            value = node.value
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "print":
                info = [ast.keyword(k, ast.Constant(v)) for k, v in
                        (("expected", expected), ("where", where), ("source", source))]
                call = ast.Call(ast.Name("__doc_check_print__", ast.Load()), value.args, value.keywords + info)
            else:
                call = ast.Call(ast.Name("__doc_check__", ast.Load()),
                                [value, ast.Constant(expected), ast.Constant(where), ast.Constant(source)], [])
            return ast.copy_location(ast.Expr(call), node)

    return ast.fix_missing_locations(Rewrite().visit(tree))


# -- running --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _tokenizer():
    from infopt.models import load_default_tokenizer

    return load_default_tokenizer()


def _tiny_pair(dtype, device):
    from infopt.models import tiny_model

    return tiny_model("llama", max_positions=2048, dtype=dtype).to(device), _tokenizer()


def _tiny_default(dtype=None, device="cpu", *, quantized=False):
    """``load_default`` under ``tiny``: a 2-layer Llama with the default tokenizer's vocabulary."""
    import torch

    if quantized:
        raise RuntimeError("load_default(quantized=True) loads the shipped int4 GGUF, which no tiny model stands in "
                           "for: mark this block <!-- test: real_model -->")
    return _tiny_pair(dtype or torch.float32, device)


def _tiny_load_model(path, *, dtype=None, device="cpu"):
    """``load_model`` under ``tiny``: the tiny model, whatever folder the doc names."""
    import torch

    return _tiny_pair(dtype or torch.float32, device)


def _refuse_default(*_args, **_kwargs):
    raise RuntimeError("this block loads a model: put <!-- test: tiny --> above it (a tiny model stands in) or "
                       "<!-- test: real_model --> (the embedded default model, under the real_model mark)")


@contextlib.contextmanager
def _models(marker: str | None):
    """Which model ``load_default``/``load_model`` give while a block runs."""
    import infopt.models as models

    if marker == "real_model":
        yield
        return
    tiny = marker == "tiny"
    saved = models.load_default, models.load_model
    models.load_default = _tiny_default if tiny else _refuse_default
    models.load_model = _tiny_load_model if tiny else _refuse_default
    try:
        yield
    finally:
        models.load_default, models.load_model = saved


@contextlib.contextmanager
def _no_network():
    """Refuse connections off this machine while a block runs: the docs' examples download nothing."""
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def check(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in _LOCAL_HOSTS:
            raise OSError(f"a doc block tried to connect to {address!r}; the docs' examples must not download")

    def connect(sock, address):
        check(sock, address)
        return real_connect(sock, address)

    def connect_ex(sock, address):
        check(sock, address)
        return real_connect_ex(sock, address)

    socket.socket.connect, socket.socket.connect_ex = connect, connect_ex
    try:
        yield
    finally:
        socket.socket.connect, socket.socket.connect_ex = real_connect, real_connect_ex


def run_block(block: Block, namespace: dict) -> None:
    """Run one block in the page's namespace; raise AssertionError when what it shows is not what it does."""
    if block.marker is None and _LOADERS.search(block.code):
        _refuse_default()
    namespace.setdefault("__name__", f"doc:{block.page}")
    namespace["__doc_check__"] = _check_value
    namespace["__doc_check_print__"] = _check_print
    with _models(block.marker), _no_network():
        if block.is_doctest:
            _run_doctest(block, namespace)
        else:
            _run_script(block, namespace)


def _run_script(block: Block, namespace: dict) -> None:
    code = compile(_instrument(block.code, block), f"{block.id}", "exec")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, namespace)
    if block.output is None or block.example_run:
        return
    want = normalize(block.output, numbers=block.numbers_vary)
    got = normalize(out.getvalue(), numbers=block.numbers_vary)
    if want != got:
        how = " (numbers compared as any number)" if block.numbers_vary else ""
        raise AssertionError(f"{block.id}: the block prints\n{out.getvalue()}\nbut the doc shows (L{block.output_line})"
                             f"{how}\n{block.output}")


def _run_doctest(block: Block, namespace: dict) -> None:
    parser = doctest.DocTestParser()
    test = parser.get_doctest(block.code, namespace, block.id, block.page, block.line)
    runner = doctest.DocTestRunner(checker=_Checker(block.numbers_vary), optionflags=_FLAGS, verbose=False)
    report = io.StringIO()
    runner.run(test, out=report.write, clear_globs=False)
    namespace.update(test.globs)  # DocTest runs on a copy of the namespace it is given
    if not runner.tries:  # a block the parser read no example from would pass vacuously
        raise AssertionError(f"{block.id}: no >>> example was found in the block")
    if runner.failures:
        raise AssertionError(report.getvalue())
