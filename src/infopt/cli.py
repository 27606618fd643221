"""The ``infopt`` command line: optimize, recipes, demo, version."""

from __future__ import annotations

import argparse
import re
import sys
import textwrap

from ._version import __version__

__all__ = ["main"]


def _cmd_recipes(args) -> int:
    from .recipe import PRESETS, available_steps

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
    print("\n`infopt recipes --fields [STAGE[:KIND]]` lists each step's fields, types and defaults")
    return 0


def _summary(doc: str | None) -> str:
    """The first sentence of a docstring's first paragraph."""
    para = " ".join((doc or "").strip().split("\n\n")[0].split())
    para = re.sub(r":\w+:`~?(?:[\w.]+\.)?(\w+)`", r"\1", para).replace("``", "")  # rst roles and literals
    head, dot, _ = para.partition(". ")
    return head + "." if dot else para


def _print_fields(which: str) -> int:
    """Each step's fields with their types and defaults, per stage and kind (all, one stage, or one kind)."""
    from .core.errors import RecipeError, did_you_mean
    from .core.step import STEP_TYPES, describe_fields
    from .recipe import available_steps

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
    from .io import save_optimized
    from .models import load_model
    from .optimize import optimize
    from .recipe import Recipe

    recipe = Recipe.parse(args.recipe)  # a bad recipe fails before the model is loaded
    model, tok = load_model(args.model)
    optimize(model, recipe, tokenizer=tok)
    print(model.infopt)
    if args.save:
        out = save_optimized(model, args.save, tokenizer=tok)
        print(f"saved to {out} (load with infopt.io.load_optimized)")
    return 0


def _cmd_demo(args) -> int:
    from .demo import main as demo_main

    return demo_main(args.rest)


# modules that add their own subcommands: each defines register(subparsers) setting `fn` on its parser
_PLUGINS = ("infopt.eval.cli", "infopt.memory.cli", "infopt.bench.cli", "infopt.tuner.cli")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="infopt", description="Composable inference optimizations for transformers LMs")
    p.add_argument("--version", action="version", version=f"infopt {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("recipes", help="list presets and available steps (--fields: their fields and defaults)")
    r.add_argument("--fields", nargs="?", const="", metavar="STAGE[:KIND]",
                   help="print each step's fields, types and defaults (all steps, one stage, or one stage:kind)")
    r.set_defaults(fn=_cmd_recipes)

    o = sub.add_parser("optimize", help="apply a recipe to a model and optionally save it")
    o.add_argument("--recipe", required=True, help="preset name or YAML/JSON recipe file")
    o.add_argument("--model", default="default", help="'default' (embedded SmolLM2-135M) or a local HF folder")
    o.add_argument("--save", help="folder to write the optimized model to")
    o.set_defaults(fn=_cmd_optimize)

    d = sub.add_parser("demo", help="run the main demo on the embedded default model (options: infopt demo --help)",
                       add_help=False)
    d.set_defaults(fn=_cmd_demo, rest=[])

    import importlib
    import importlib.util

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
    from .core.errors import InfoptError

    try:
        return args.fn(args)
    except (InfoptError, FileNotFoundError, ValueError) as e:
        print(f"infopt: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
