"""The ``infopt`` command line: optimize, recipes, demo, version; ``eval``, ``memory``, ``bench`` and ``tune`` from the
modules beside this one (``infopt.cli.eval``, ...). The top floor: it imports the library, nothing imports it."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

from .._version import __version__
from ..core.errors import InfoptError, RecipeError, did_you_mean
from ..core.step import STEP_TYPES, describe_fields
from ..io import save_optimized
from ..models import load_model
from ..optimize import explain, optimize
from ..recipe import PRESETS, Recipe, available_steps

__all__ = ["main"]


def _cmd_recipes(args) -> int:
    if args.name is not None:
        if args.fields is not None:
            raise RecipeError(f"give a preset name or --fields, not both: `infopt recipes {args.name}` prints the "
                              "preset, `infopt recipes --fields STAGE[:KIND]` a step's fields")
        return _print_recipe(args.name, args.results)
    if args.fields is not None:
        return _print_fields(args.fields)
    w = max(len(n) for n in PRESETS)
    print("presets:")
    for name, p in PRESETS.items():
        print(f"  {name:<{w}}  {p.description}")
    print("\nsteps (stage: kinds), applied in this order:")
    for stage, kinds in available_steps().items():
        ks = ", ".join(k for k in kinds if k) or "-"
        print(f"  {stage}: {ks}")
    print("\n`infopt recipes NAME` prints a preset as a recipe file, with its measured figures;")
    print("`infopt recipes --fields [STAGE[:KIND]]` lists each step's fields, types and defaults")
    return 0


# -- infopt recipes NAME: a preset as a recipe file, with what was measured for it ---------------------------------

DEFAULT_MODEL = "SmolLM2-135M-Instruct"  # the model name the benchmark results record for the default model
_WIDTH = 110


def _source_results() -> Path:
    """benchmarks/results of the source checkout this package runs from (absent from an installed wheel)."""
    return Path(__file__).resolve().parents[3] / "benchmarks" / "results"


def _print_recipe(name: str, results: str | None) -> int:
    """Print preset ``name`` (or a recipe file) as the YAML ``infopt.optimize`` reads, after comments giving its
    description and the figures measured for it, each with the results file it comes from."""
    folder = Path(results) if results is not None else _source_results()
    shown = results if results is not None else "benchmarks/results"
    if name in PRESETS:
        recipe = Recipe.parse(name)
        head = [f"{name}: {PRESETS[name].description}", ""] + _figure_lines(name, recipe, folder, shown)
        use = name
    elif Path(name).suffix.lower() in (".yaml", ".yml", ".json") or Path(name).is_file():
        recipe = Recipe.parse(name)
        head = [f"recipe file {name}: {recipe.describe()} (measured figures are kept for the presets only)"]
        use = name
    else:
        raise RecipeError(f"unknown preset {name!r}.{did_you_mean(name, PRESETS)} Presets: {', '.join(PRESETS)} "
                          "(`infopt recipes` describes each); a .yaml/.json recipe file is read too")
    head += ["", f"Apply it: infopt optimize --recipe {use} --model default [--dry-run] [--save DIR], or "
                 f"infopt.optimize(model, {use!r}) in Python. This YAML is what it applies: save it to a file, edit "
                 "it and pass the file instead."]
    for line in head:
        wrapped = textwrap.wrap(line, _WIDTH - 2, subsequent_indent="    " if line.startswith("  ") else "  ",
                                break_on_hyphens=False) or [""]  # file names stay whole
        for w in wrapped:
            print(f"# {w}".rstrip())
    print(recipe.to_yaml(), end="")
    return 0


def _figure_lines(name: str, recipe, folder: Path, shown: str) -> list[str]:
    """The comment lines giving what the results in ``folder`` (named ``shown``) measured for preset ``name`` on
    the default model."""
    if not folder.is_dir():
        return [f"Measured figures (apply time, memory, quality, speed on {DEFAULT_MODEL}) are kept in "
                "benchmarks/results/*.json of the infopt source repository, which is not installed with the "
                f"package (no folder {folder}); docs/performance.md summarises them."]
    files = _read_results(folder)
    runs = [(f, d) for f, d in files if d.get("recipe") == name and _number(d.get("optimize_s"))]
    runs.sort(key=lambda fd: (fd[0] != f"startup-{name}.json", _negated_date(fd[1])))
    benches = [(f, d) for f, d in files if isinstance(d.get("recipe"), dict) and d["recipe"].get("name") == name
               and d.get("model") == DEFAULT_MODEL and isinstance(d.get("optimized"), dict)
               and isinstance(d.get("baseline"), dict)]
    preferred = {f"decode-{name}.json": 0, f"batch-{name}.json": 1}  # what benchmarks/run_all.py writes
    benches.sort(key=lambda fd: (preferred.get(fd[0], 2), _negated_date(fd[1])))
    gpu_rows = _gpu_rows(files, name)

    studies = [(f, d, d["summary"][name]) for f, d in files if isinstance(d.get("summary"), dict)
               and isinstance(d["summary"].get(name), dict) and _number(d["summary"][name].get("cold_apply_s"))]
    studies.sort(key=lambda fds: _negated_date(fds[1]))

    out = [f"Measured on the default model ({DEFAULT_MODEL}); each figure names its file under {shown}:"]
    if studies:  # benchmarks/studies/apply_time.py: a new machine's first apply, then with the caches it filled
        f, d, s = studies[0]
        warm = s.get("warm_apply_s_median")
        cold = s["cold_apply_s"]
        line = (f"  apply time: {cold:.0f}" if cold >= 100 else f"  apply time: {cold:.1f}") + \
            " s for infopt.optimize on a new machine (empty compile caches)"
        fields = "cold_apply_s"
        if _number(warm):
            line += f", {warm:.1f} s in later processes (the caches filled)"
            fields += ", warm_apply_s_median"
        out.append(line + f" ({f}: summary.{name}: {fields}; {_machine(d)})")
    elif runs:
        f, d = runs[0]
        line = (f"  apply time: {d['optimize_s']:.1f} s for infopt.optimize, compile caches as that run found them "
                f"({f}: optimize_s; {_machine(d)})")
        others = [f"{o['optimize_s']:.1f} s ({g}, {_date(o)})" for g, o in runs[1:5]]
        if others:
            line += "; other runs, with other cache states: " + ", ".join(others)
        out.append(line)
    elif gpu_rows and _number(gpu_rows[0][1].get("apply_s")):
        f, row, d = gpu_rows[0]
        out.append(f"  apply time: {row['apply_s']:.1f} s for infopt.optimize ({f}: apply_s; {_machine(d)})")
    else:
        out.append("  apply time: not measured")
    if benches:
        f, d = benches[0]
        b, o = d["baseline"], d["optimized"]
        if _number(b.get("model_mb")) and _number(o.get("model_mb")):
            line = (f"  memory: parameters+buffers {b['model_mb']:.1f} -> {o['model_mb']:.1f} MiB "
                    f"(x{o['model_mb'] / b['model_mb']:.2f})")
            if _number(b.get("peak_rss_mb")) and _number(o.get("peak_rss_mb")):
                line += f", peak RSS {b['peak_rss_mb']:.0f} -> {o['peak_rss_mb']:.0f} MiB"
            out.append(line + f" against plain transformers ({f}: baseline/optimized model_mb, peak_rss_mb; "
                              f"{_machine(d)})")
        else:
            out.append("  memory: not measured")
        out.append(_quality_line(d.get("quality"), d.get("exact_greedy"), f"{f}: quality"
                                 + (", exact_greedy" if isinstance(d.get("exact_greedy"), bool) else "")))
        if _number(b.get("tokens_per_s")) and _number(o.get("tokens_per_s")):
            wl = (d.get("workload") or {}).get("description", "its workload")
            out.append(f"  speed: {b['tokens_per_s']:.1f} -> {o['tokens_per_s']:.1f} tokens/s "
                       f"(x{o['tokens_per_s'] / b['tokens_per_s']:.2f}) on {wl} ({f}: tokens_per_s)")
        changed = _recipe_changes(d["recipe"].get("steps") or [], recipe)
        if changed:
            out.append(f"  note: {f} recorded an earlier form of this preset ({'; '.join(changed)}); the figures "
                       "are those of the recipe it recorded")
        if len(benches) > 1:
            out.append("  also measured in: " + ", ".join(g for g, _ in benches[1:]))
    elif gpu_rows and isinstance(gpu_rows[0][1].get("quality"), dict):
        f, row, d = gpu_rows[0]
        out.append("  memory: not measured")
        exact = row.get("token_identical_to_plain")
        out.append(_quality_line(row["quality"], exact, f"{f}: quality"
                                 + (", token_identical_to_plain" if isinstance(exact, bool) else "")
                                 + f"; {_machine(d)}"))
    else:
        out += ["  memory: not measured", "  quality: not measured"]
    return out


def _quality_line(q: Any, exact: Any, source: str) -> str:
    if not isinstance(q, dict) or not _number(q.get("kl")):
        return "  quality: not measured"
    parts = [f"KL {q['kl']:.4f} nats/token" + (f" (max {q['kl_max']:.4f})" if _number(q.get("kl_max")) else "")]
    if _number(q.get("top1")):
        parts.append(f"top-1 agreement {100 * q['top1']:.2f}%")
    if _number(q.get("ppl")) and _number(q.get("ppl_ref")):
        parts.append(f"perplexity {q['ppl']:.2f} against {q['ppl_ref']:.2f}")
    text = ", ".join(parts) + (f" over {q['tokens']} tokens" if _number(q.get("tokens")) else "")
    if isinstance(exact, bool):
        text += f"; greedy tokens identical to plain transformers: {'yes' if exact else 'no'}"
    return f"  quality: {text} ({source})"


def _read_results(folder: Path) -> list[tuple[str, dict]]:
    """``(name relative to folder, data)`` of each JSON object in ``folder`` and its ``gpu/`` subfolder."""
    out = []
    for path in sorted([*folder.glob("*.json"), *folder.glob("gpu/*.json")]):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):  # a file being written, or not JSON: it holds no figure to show
            continue
        if isinstance(data, dict):
            out.append((path.relative_to(folder).as_posix(), data))
    return out


def _gpu_rows(files: list[tuple[str, dict]], name: str) -> list[tuple[str, dict, dict]]:
    """``(file, row, run)`` for each GPU-lane row measuring preset ``name`` on the default model, newest first (a
    lane file keeps sections like ``{"model": "default", "dtype": ..., "rows": [{"recipe": ..., "apply_s": ...}]}``;
    ``run`` is the section, with the file's machine where the section records none)."""
    out = []
    for f, data in files:
        for section in data.values():
            if not isinstance(section, dict) or section.get("model") not in ("default", DEFAULT_MODEL):
                continue
            run = section if section.get("machine") else {**section, "machine": data.get("machine")}
            out += [(f, row, run) for row in section.get("rows") or []
                    if isinstance(row, dict) and row.get("recipe") == name]
    return sorted(out, key=lambda frs: _negated_date(frs[2]))


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _date(d: dict) -> str:
    return str((d.get("machine") or {}).get("date") or "undated")[:10]


def _negated_date(d: dict) -> tuple:
    """Sorts newest first (ISO dates compared as text, each character negated), undated last."""
    date = str((d.get("machine") or {}).get("date") or "")
    return tuple(-ord(c) for c in date) if date else (1,)


def _machine(d: dict) -> str:
    m = d.get("machine") or {}
    where = m.get("gpu") or m.get("cpu") or "machine not recorded"
    threads = f", {m['threads']} threads" if m.get("threads") and not m.get("gpu") else ""
    dtype = f", {d['dtype']}" if isinstance(d.get("dtype"), str) else ""  # a GPU-lane run names its dtype
    return f"{where}{threads}{dtype}, {_date(d)}"


def _recipe_changes(recorded: list, recipe) -> list[str]:
    """How the steps a results file recorded differ from ``recipe``'s: steps added or dropped, fields whose value
    changed, and fields set now to a non-default value that the record does not have (added since)."""
    then = {stage: body if isinstance(body, dict) else {}  # a shorthand ({attention: sdpa}) has no fields to compare
            for s in recorded if isinstance(s, dict) and len(s) == 1 for stage, body in s.items()}
    now = {s.stage: (s, s.to_dict()[s.stage]) for s in recipe.steps}
    out = []
    if set(then) != set(now):
        out.append(f"steps then: {', '.join(then) or 'none'}; now: {', '.join(now)}")
    for stage in [st for st in now if st in then]:
        step, body = now[stage]
        try:
            default = type(step)().to_dict()[stage]
        except (InfoptError, TypeError):  # a step that needs a field set has no default form
            default = {}
        old, new, base = _flat(then[stage]), _flat(body), _flat(default)
        for key in new:
            if key in old and old[key] != new[key]:
                out.append(f"{stage}.{key} {_yaml(old[key])} then, {_yaml(new[key])} now")
            elif key not in old and key in base and base[key] != new[key]:
                out.append(f"{stage}.{key} not recorded then, {_yaml(new[key])} now")
    return out


def _flat(body: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in body.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def _yaml(v: Any) -> str:
    """A value as the YAML below spells it (true, null, auto)."""
    return v if isinstance(v, str) else json.dumps(v)


def _summary(doc: str | None) -> str:
    """The first sentence of a docstring's first paragraph."""
    para = " ".join((doc or "").strip().split("\n\n")[0].split())
    para = re.sub(r":\w+:`~?(?:[\w.]+\.)?(\w+)`", r"\1", para).replace("``", "")  # rst roles and literals
    head, dot, _ = para.partition(". ")
    return head + "." if dot else para


def _print_fields(which: str) -> int:
    """Each step's fields with their types and defaults, per stage and kind (all, one stage, or one kind)."""
    steps = available_steps()
    stage, _, kind = which.partition(":")
    if which and stage not in steps:
        raise RecipeError(f"unknown stage {stage!r}; stages: {', '.join(steps)}.{did_you_mean(stage, steps)}")
    if kind and kind not in steps[stage]:
        allowed = ", ".join(k for k in steps[stage] if k) or "(one kind only)"
        raise RecipeError(f"unknown {stage} kind {kind!r}; allowed: {allowed}.{did_you_mean(kind, steps[stage])}")
    first = True
    for st, kinds in steps.items():
        if which and st != stage:
            continue
        for k in kinds:
            if kind and k != kind:
                continue
            cls = STEP_TYPES[st][k]
            doc = _summary(cls.__doc__)
            selector = f"{cls.discriminator}: {k}" if k is not None else ""
            if not first:
                print()
            first = False
            print(f"{st}{':' + k if k else ''}  ({cls.__name__}{', ' + selector if selector else ''})")
            if doc:
                print(textwrap.fill(doc, 110, initial_indent="  ", subsequent_indent="  "))
            rows = describe_fields(cls)
            if not rows:
                print("    (no fields)")
                continue
            wn = max(len(n) for n, _, _ in rows)
            wt = max(len(t) for _, t, _ in rows)
            for name, typ, default in rows:
                print(f"    {name:<{wn}}  {typ:<{wt}}  = {default}")
    return 0


def _cmd_optimize(args) -> int:
    recipe = Recipe.parse(args.recipe)  # a bad recipe fails before the model is loaded
    model, tok = load_model(args.model)
    if args.dry_run:  # validated against the model and described; nothing applied, nothing written
        print(explain(model, recipe))
        if args.save:
            print(f"--dry-run: nothing was saved; without it the optimized model would be saved to {args.save}")
        return 0
    optimize(model, recipe, tokenizer=tok)
    print(model.infopt)
    if args.save:
        out = save_optimized(model, args.save, tokenizer=tok)
        print(f"saved to {out} (load with infopt.io.load_optimized)")
    return 0


def _cmd_demo(args) -> int:
    from ..demo import main as demo_main  # (not loaded by import infopt; it loads the eval package)

    return demo_main(args.rest)


# modules that add their own subcommands: each defines register(subparsers) setting `fn` on its parser
_PLUGINS = ("infopt.cli.eval", "infopt.cli.memory", "infopt.cli.bench", "infopt.cli.tune")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="infopt", description="Composable inference optimizations for transformers LMs")
    p.add_argument("--version", action="version", version=f"infopt {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("recipes", help="list presets and available steps; NAME: print a preset as a recipe file with "
                                       "its measured figures (--fields: each step's fields and defaults)")
    r.add_argument("name", nargs="?", metavar="NAME",
                   help="a preset (or a .yaml/.json recipe file) to print as YAML, with its description and the apply "
                        "time, memory and quality measured for it")
    r.add_argument("--fields", nargs="?", const="", metavar="STAGE[:KIND]",
                   help="print each step's fields, types and defaults (all steps, one stage, or one stage:kind)")
    r.add_argument("--results", metavar="DIR",
                   help="benchmark results folder the figures are read from (default: benchmarks/results of the "
                        "source checkout infopt runs from)")
    r.set_defaults(fn=_cmd_recipes)

    o = sub.add_parser("optimize", help="apply a recipe to a model and optionally save it")
    o.add_argument("--recipe", required=True, help="preset name or YAML/JSON recipe file")
    o.add_argument("--model", default="default", help="'default' (embedded SmolLM2-135M) or a local HF folder")
    o.add_argument("--save", help="folder to write the optimized model to")
    o.add_argument("--dry-run", action="store_true",
                   help="validate the recipe against the model and print the plan (the steps in the order they run, "
                        "their fields, the fallbacks they will take) without applying or saving anything")
    o.set_defaults(fn=_cmd_optimize)

    d = sub.add_parser("demo", help="run the main demo on the embedded default model (options: infopt demo --help)",
                       add_help=False)
    d.set_defaults(fn=_cmd_demo, rest=[])

    for name in _PLUGINS:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # the parent package is absent
            found = False
        if found:
            importlib.import_module(name).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "demo":  # the demo parses its own options
        args.rest = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.fn(args)
    except (InfoptError, FileNotFoundError, ValueError) as e:
        print(f"infopt: error: {e}", file=sys.stderr)
        return 2

