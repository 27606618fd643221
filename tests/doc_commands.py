"""The commands and recipes the docs show, checked against the repository (used by tests/test_doc_commands.py).

Commands come from ```bash (``sh``, ``shell``, ``console``) blocks and from inline code spans that start with a
command (```python benchmarks/x.py ...```, ```infopt bench ...```, ```make demo```, ```scripts/gpu_lane.sh gpu```,
```torchrun ... benchmarks/x.py```). Each is checked for what a reader would run:

- ``make TARGET``: the target is in the Makefile;
- ``python SCRIPT`` (or ``torchrun ... SCRIPT``): the script exists, and its flags are among the ``add_argument``
  option strings of the script (read from its source, not run: benchmarks load models at import);
- ``infopt CMD`` (or ``python -m infopt[.cli]``, ``python -m infopt.demo``): the command exists and takes the flags
  (its ``--help``, built in process); a command line of a shell block written without placeholders parses with
  infopt's own parser (choices and required options included), where a mention in prose (```infopt eval```) need
  only name what exists;
- ``--recipe NAME``: a preset (or ``none``) when it is a bare name;
- ``scripts/X.sh STAGE``: the script exists, is executable, and names the stage as a ``case`` label;
- every path under the repository's own folders (``benchmarks/``, ``scripts/``, ``examples/``, ``tests/``,
  ``docs/``, ``src/``) that those commands name exists, results files included (``pip``, ``git`` and ``pytest`` lines
  are the reader's own and are not checked).

Placeholders (``<file>``, ``FILE``, ``a|b``, ``[--flag]``, ``...``) are allowed where a value goes.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from .doc_blocks import ROOT, pages, parse_page

SHELL_LANGS = ("bash", "sh", "shell", "console")
REPO_DIRS = ("benchmarks/", "scripts/", "examples/", "tests/", "docs/", "src/")
_OPERATORS = {"&&", "||", ";", "|", "&", ">", ">>", "<", "2>", "2>&1"}
_STARTS = re.compile(r"^(?:\S*python3? (?:-m infopt|\S+\.py)|infopt (?:[a-z]|--)|make [a-z]|torchrun |\.?/?scripts/\S+\.sh)")
_PLACEHOLDER = re.compile(r"[<>|\[\]]|\.\.\.|^[A-Z][A-Z_0-9]*$|[A-Z]{4,}")
_FLAG = re.compile(r"^--?[A-Za-z][\w-]*")
_SPAN = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)*)`(?!`)")


@dataclass
class Command:
    where: str  # page:Lline
    argv: list[str]
    text: str
    whole: bool = True  # a command line to run (a shell block), not a mention in prose (`infopt eval`)


def _split(text: str) -> list[list[str]]:
    """The simple commands of a shell text: comments dropped, lines continued, split at ``&&``, ``;``, pipes and
    redirections (a redirection's target dropped); ``<placeholder>`` kept as one word."""
    text = re.sub(r"<[^<>\n]+>", lambda m: "PLACEHOLDER" if " " in m[0] else m[0].strip("<>").upper(), text)
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = re.sub(r"^\s*\$\s+", "", line)  # a prompt
        try:
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            words = list(lexer)
        except ValueError:
            continue
        cmd: list[str] = []
        skip = False
        for w in words:
            if skip:
                skip = False
                continue
            if w in _OPERATORS or set(w) <= set(";&|<>"):
                if cmd:
                    out.append(cmd)
                cmd = []
                skip = w in (">", ">>", "<", "2>")
                continue
            cmd.append(w)
        if cmd:
            out.append(cmd)
    return out


def block_commands(path: Path) -> list[Command]:
    found = []
    for block in parse_page(path):
        if block.lang not in SHELL_LANGS:
            continue
        code_lines, at = block.code.splitlines(), 0
        for argv in _split(block.code):
            at = next((i for i in range(at, len(code_lines)) if argv[0] in code_lines[i]), at)
            found.append(Command(f"{block.page}:L{block.line + 1 + at}", argv, " ".join(argv)))
    return found


def inline_commands(path: Path) -> list[Command]:
    """Commands written as inline code in the page's prose (fenced blocks left out)."""
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    lines, fence = [], None
    for line in path.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^\s*(`{3,})", line)
        if fence is None and m:
            fence = m.group(1)
            lines.append("")
        elif fence is not None:
            if line.strip() == fence:
                fence = None
            lines.append("")
        else:
            lines.append(line)
    text = "\n".join(lines)
    found = []
    for m in _SPAN.finditer(text):
        span = " ".join(m[1].split())
        if not _STARTS.match(span) or span in ("infopt", "torchrun", "make"):
            continue
        span = re.sub(r"\[(--?[\w-]+(?: [^\]]+)?)\]", r"\1", span)  # an optional flag shown in brackets
        where = f"{rel}:L{text.count(chr(10), 0, m.start()) + 1}"
        found.extend(Command(where, argv, span, whole=False) for argv in _split(span))
    return found


def all_commands() -> list[Command]:
    return [c for p in pages() for c in (*block_commands(p), *inline_commands(p))]


# -- what the repository offers -------------------------------------------------------------------------------


@functools.cache
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    return frozenset(m[1] for m in re.finditer(r"^([\w-]+)\s*:(?!=)", text, flags=re.M))


@functools.cache
def script_options(path: Path) -> frozenset[str] | None:
    """The option strings a Python script's argparse takes, read from its ``add_argument`` calls (None: it has no
    ``add_argument`` call)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    options, calls = {"-h", "--help"}, 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            calls += 1
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("-"):
                    options.add(arg.value)
    return frozenset(options) if calls else None


@functools.cache
def _infopt_parser():
    from infopt.cli import build_parser

    return build_parser()


def _help_options(text: str) -> frozenset[str]:
    return frozenset(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", text))


@functools.cache
def infopt_options(command: str) -> frozenset[str] | None:
    """The options ``infopt COMMAND`` takes, read from its ``--help`` (None: no such command)."""
    if command not in infopt_commands():
        return None
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        if command == "demo":  # the demo parses its own options
            from infopt.demo import main

            main(["--help"])
        else:
            _infopt_parser().parse_args([command, "--help"])
    return _help_options(out.getvalue())


@functools.cache
def infopt_commands() -> tuple[str, ...]:
    """The commands ``infopt --help`` lists (``{recipes,optimize,...}``)."""
    m = re.search(r"\{([\w,-]+)\}", _infopt_parser().format_usage())
    return tuple(m[1].split(",")) if m else ()


def _parse_error(argv: list[str]) -> str | None:
    """What infopt's own parser says about ``infopt ARGV`` (None: it parses)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args, extra = _infopt_parser().parse_known_args(argv)
    except SystemExit as e:
        return err.getvalue().strip().splitlines()[-1] if e.code else None
    if extra and argv[0] != "demo":
        return f"unrecognized arguments: {' '.join(extra)}"
    return None


@functools.cache
def _presets() -> frozenset[str]:
    from infopt.recipe import PRESETS

    return frozenset(PRESETS)


# -- checking -------------------------------------------------------------------------------------------------


def _is_placeholder(word: str) -> bool:
    return bool(_PLACEHOLDER.search(word))


def _flags(args: list[str]) -> list[str]:
    return [m[0] for w in args if (m := _FLAG.match(w))]


def _check_flags(flags: list[str], known: frozenset[str] | None, what: str) -> list[str]:
    if known is None:
        return [f"{what} takes no options (no add_argument), the doc passes {' '.join(flags)}"] if flags else []
    return [f"{what} has no option {f} (it takes {', '.join(sorted(known - {'-h', '--help'}))})"
            for f in flags if f not in known]


def _check_recipe_values(args: list[str]) -> list[str]:
    problems = []
    for flag, value in zip(args, args[1:], strict=False):
        if flag != "--recipe" or _is_placeholder(value) or "/" in value or "." in value or "," in value:
            continue
        if value not in _presets() and value != "none":
            problems.append(f"--recipe {value}: not a preset ({', '.join(sorted(_presets()))})")
    return problems


def _check_paths(argv: list[str]) -> list[str]:
    problems = []
    for w in argv:
        w = w.split("=", 1)[1] if w.startswith("--") and "=" in w else w
        w = w.removeprefix("./")
        if not w.startswith(REPO_DIRS) or _is_placeholder(w) or "*" in w:
            continue
        if not (ROOT / w).exists():
            problems.append(f"{w} does not exist in the repository")
    return problems


def _check_infopt(args: list[str], whole: bool = True) -> list[str]:
    if not args or args[0] in ("--version", "-h", "--help"):
        return []
    command, rest = args[0], args[1:]
    known = infopt_options(command)
    if known is None:
        return [f"infopt has no command {command!r} ({', '.join(infopt_commands())})"]
    problems = _check_flags(_flags(rest), known, f"infopt {command}")
    if whole and not problems and command != "demo" and not any(_is_placeholder(w) for w in rest):
        if (err := _parse_error(args)) is not None:
            problems.append(f"infopt {' '.join(args)}: {err}")
    return problems + _check_recipe_values(rest)


def _check_script(script: str, args: list[str]) -> list[str]:
    if _is_placeholder(script) or "/" not in script:  # "script.py": the reader's own
        return []
    path = ROOT / script.removeprefix("./")
    if not path.is_file():
        return [f"{script} does not exist"]
    if path.suffix != ".py":
        return []
    return _check_flags(_flags(args), script_options(path), script) + _check_recipe_values(args)


def _check_shell_script(script: str, args: list[str]) -> list[str]:
    path = ROOT / script.removeprefix("./")
    if not path.is_file():
        return [f"{script} does not exist"]
    problems = [] if path.stat().st_mode & 0o111 else [f"{script} is not executable"]
    labels = {lab for m in re.finditer(r"^\s*([\w|-]+)\)", path.read_text(), flags=re.M) for lab in m[1].split("|")}
    for a in args:
        stage = a.split(":", 1)[0]
        if not a.startswith("-") and not _is_placeholder(a) and stage not in labels:
            problems.append(f"{script} names no stage {stage!r} (its case labels: {', '.join(sorted(labels))})")
    return problems


def check(cmd: Command) -> list[str]:
    """What is wrong with a command the doc shows, as messages (empty: nothing)."""
    argv = list(cmd.argv)
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):  # VAR=value prefixes
        argv.pop(0)
    if not argv:
        return []
    prog, args = argv[0], argv[1:]
    name = prog.rsplit("/", 1)[-1]
    if name not in ("python", "python3", "infopt", "make", "torchrun") and not prog.removeprefix("./").startswith(
            "scripts/"):
        return []  # pip, git, pytest on the reader's own tests, ...
    problems = _check_paths(argv)
    if name in ("python", "python3"):
        if args[:2] in (["-m", "infopt"], ["-m", "infopt.cli"]):
            problems += _check_infopt(args[2:], cmd.whole)
        elif args[:2] == ["-m", "infopt.demo"]:
            problems += _check_infopt(["demo", *args[2:]], cmd.whole)
        elif args and args[0] == "-m" and len(args) > 1 and args[1].startswith("infopt"):
            problems.append(f"python -m {args[1]}: not a command line of infopt")
        elif args and not args[0].startswith("-"):
            problems += _check_script(args[0], args[1:])
    elif prog == "infopt":
        problems += _check_infopt(args, cmd.whole)
    elif prog == "make":
        problems += [f"make {t}: no such target in the Makefile ({', '.join(sorted(make_targets()))})"
                     for t in args if not t.startswith("-") and "=" not in t and t not in make_targets()]
    elif prog == "torchrun":
        script = next((i for i, a in enumerate(args) if a.endswith(".py")), None)
        if script is not None:
            problems += _check_script(args[script], args[script + 1:])
    elif prog.removeprefix("./").startswith("scripts/"):
        problems += _check_shell_script(prog, args)
    return problems
