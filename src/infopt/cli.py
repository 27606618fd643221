"""The ``infopt`` command line: optimize, recipes, demo, version."""

from __future__ import annotations

import argparse
import sys

from ._version import __version__

__all__ = ["main"]


def _cmd_recipes(args) -> int:
    from .recipe import PRESETS, available_steps

    w = max(len(n) for n in PRESETS)
    print("presets:")
    for name, p in PRESETS.items():
        print(f"  {name:<{w}}  {p.description}")
    print("\nsteps (stage: kinds), applied in this order:")
    for stage, kinds in available_steps().items():
        ks = ", ".join(k for k in kinds if k) or "-"
        print(f"  {stage}: {ks}")
    return 0


def _cmd_optimize(args) -> int:
    from .io import save_optimized
    from .models import load_model
    from .optimize import optimize

    model, tok = load_model(args.model)
    optimize(model, args.recipe, tokenizer=tok)
    print(model.infopt)
    if args.save:
        out = save_optimized(model, args.save, tokenizer=tok)
        print(f"saved to {out} (load with infopt.io.load_optimized)")
    return 0


def _cmd_demo(args) -> int:
    from .demo import main as demo_main

    return demo_main(args.rest)


# modules that add their own subcommands: each defines register(subparsers) setting `fn` on its parser
_PLUGINS = ("infopt.eval.cli", "infopt.memory.cli", "infopt.bench.cli")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="infopt", description="Composable inference optimizations for transformers LMs")
    p.add_argument("--version", action="version", version=f"infopt {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("recipes", help="list presets and available steps")
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
