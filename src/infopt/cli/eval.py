"""``infopt eval``: apply a recipe to a model and measure perplexity, KL and top-1 against the original."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..core.errors import InfoptError
from ..models import load_default_tokenizer, load_model
from ..optimize import optimize
from ..recipe import Recipe

__all__ = ["register", "run"]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``eval`` subcommand to the ``infopt`` command line.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers()`` returned.

    Returns:
        The ``eval`` parser (its ``fn`` default is :func:`run`).

    Raises:
        argparse.ArgumentError: a subcommand named ``eval`` exists already.

    Example:
        >>> import argparse
        >>> p = argparse.ArgumentParser(prog="infopt")
        >>> _ = register(p.add_subparsers(dest="command"))
        >>> p.parse_args(["eval", "--recipe", "cpu-fast"]).max_tokens
        4096
    """
    e = subparsers.add_parser(
        "eval", help="apply a recipe and measure perplexity, KL and top-1 agreement against the original",
        description="Compute the reference from the unoptimized model, apply the recipe, evaluate the optimized "
                    "model on the same windows, print a table and optionally write JSON. Exit status 1 when the "
                    "recipe's gate fails, 2 on an error.")
    e.add_argument("--recipe", required=True, help="preset name or YAML/JSON recipe file")
    e.add_argument("--model", default="default", help="'default' (embedded SmolLM2-135M) or a local HF folder")
    e.add_argument("--text", help="UTF-8 text file to evaluate on (default: Python's pydoc_data.topics)")
    e.add_argument("--max-tokens", type=int, default=4096, help="tokens of the text to evaluate (default 4096)")
    e.add_argument("--window", type=int, help="tokens per forward (default min(model context, 1024))")
    e.add_argument("--stride", type=int, help="step between windows (default window // 2)")
    e.add_argument("--reference", metavar="FILE",
                   help="cache the reference in FILE (safetensors): computed on the first run, loaded afterwards")
    e.add_argument("--json", metavar="OUT", help="write the figures as JSON to OUT")
    e.set_defaults(fn=run)
    return e


def run(args: argparse.Namespace) -> int:
    """Carry out ``infopt eval`` (see :func:`register` for the options).

    Args:
        args: the parsed command line.

    Returns:
        0 on success, 1 when the recipe's gate fails, 2 on a bad input (message on stderr).

    Raises:
        InfoptError: recipe, model or backend problems (``infopt.cli.main`` prints them, exit 2).

    Example:
        >>> from infopt.cli import main
        >>> main(["eval", "--recipe", "cpu-fast", "--max-tokens", "512"])  # doctest: +SKIP
        0
    """
    try:
        return _run(args)
    except InfoptError:
        raise
    except ValueError as e:
        print(f"infopt: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from ..eval.metrics import gate_failures  # infopt.eval is not loaded by import infopt: only when the command runs
    from ..eval.quality import evaluate, make_reference, reference_for

    for name in ("max_tokens", "window", "stride"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise ValueError(f"--{name.replace('_', '-')}={v} must be a positive integer")
    recipe = Recipe.parse(args.recipe)  # a bad recipe fails before the model is loaded
    text = Path(args.text) if args.text else None
    if text is not None and not text.is_file():
        raise FileNotFoundError(f"--text file '{text}' does not exist")
    t0 = time.perf_counter()
    model, tok = load_model(args.model)
    if tok is None:  # a folder without tokenizer files: the default model's, as encode_text would pick
        tok = load_default_tokenizer()
    t_load = time.perf_counter() - t0
    opts = dict(tokenizer=tok, max_tokens=args.max_tokens, stride=args.stride, window=args.window)
    t0 = time.perf_counter()
    if args.reference:
        ref = reference_for(model, args.reference, text, **opts)
    else:
        ref = make_reference(model, text, **opts)
    t_ref = time.perf_counter() - t0
    t0 = time.perf_counter()
    optimize(model, recipe, gate={})  # the gate is checked below, on this evaluation's figures
    t_opt = time.perf_counter() - t0
    result = evaluate(model, ref, tokenizer=tok)
    failed = gate_failures(result.to_dict(), recipe.gate) if recipe.gate else []

    print(f"infopt eval: recipe {recipe.name or args.recipe} ({recipe.describe()}) on model {args.model}")
    print(f"text: {args.text or 'pydoc_data.topics'}; loaded in {t_load:.1f}s, reference {t_ref:.1f}s "
          f"({'cached at ' + args.reference if args.reference else 'fp16 log-probs in memory'}), "
          f"optimized in {t_opt:.1f}s\n")
    print(result)
    if recipe.gate:
        print("\nquality gate " + ("FAILED: " + "; ".join(failed) if failed else f"passed: {recipe.gate}"))
    if args.json:
        out = {
            "recipe": recipe.to_dict(),
            "model": args.model,
            "text": args.text or "pydoc_data.topics",
            "reference_cache": args.reference,
            "result": result.to_dict(),
            "gate": {"limits": recipe.gate, "failures": failed} if recipe.gate else None,
            "report": model.infopt.to_dict(),
            "seconds": {"load": t_load, "reference": t_ref, "optimize": t_opt, "evaluate": result.seconds},
            "torch": torch.__version__,
        }
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2, default=str) + "\n")
        print(f"\nwrote {path}")
    return 1 if failed else 0
