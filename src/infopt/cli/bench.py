"""``infopt bench``: run a workload through plain transformers and a recipe; or compare two result files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ..models import load_model

__all__ = ["register", "resolve_device", "DTYPES"]

DTYPES = ("float32", "bfloat16", "float16")
"""Values of ``--dtype``: the dtype the model is loaded in."""


def resolve_device(name: str) -> torch.device:
    """The torch device ``--device`` names (``auto``: CUDA when one is visible, else CPU).

    Args:
        name: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``.

    Returns:
        The device.

    Raises:
        ValueError: a name torch does not parse, or a CUDA device on a machine without one.

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r} is not a device torch knows ({e}); use cpu, cuda, cuda:N or auto") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is visible to torch {torch.__version__}; use --device cpu")
    return device


def _run(args) -> int:
    from ..bench.report import compare_runs, format_table  # infopt.bench is not loaded by import infopt

    if args.compare:
        a, b = (json.loads(Path(p).read_text()) for p in args.compare)
        print(compare_runs(a, b))
        return 0
    from ..bench.harness import run_bench
    from ..bench.report import append_csv, plot

    device = resolve_device(args.device)
    model, tok = load_model(args.model, dtype=getattr(torch, args.dtype), device=device)
    if tok is None:
        raise FileNotFoundError(f"{args.model} has no tokenizer; the benchmark workloads need one")
    result = run_bench(model, tok, args.recipe, args.workload, repeats=args.repeats, seed=args.seed,
                       num_requests=args.requests, progress=not args.quiet,
                       model_name="SmolLM2-135M-Instruct" if args.model == "default" else str(args.model),
                       baselines=args.baselines.split(",") if args.baselines else None)
    print(format_table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.json}")
    if args.plot:
        print(f"wrote {plot(result, args.plot)}")
    if args.csv:
        append_csv(result, args.csv)
    if result.get("valid") is False:
        print("infopt bench: the run is not valid: a graph was compiled during the timed runs (see above)",
              file=sys.stderr)
        return 1
    return 0


def register(sub) -> None:
    from ..bench.workloads import WORKLOADS

    p = sub.add_parser("bench", help="benchmark a recipe against plain transformers on one workload")
    p.add_argument("--workload", default="decode", choices=list(WORKLOADS))
    p.add_argument("--recipe", default="none", help="preset, recipe file, or 'none' (baseline only)")
    p.add_argument("--model", default="default",
                   help="'default', a local HF folder, or 'random:FAMILY' (random weights in a real checkpoint's "
                        "shapes; FAMILY: qwen2, qwen3, gemma3, gpt2, or a full size: qwen2.5-0.5b, llama3.2-1b, "
                        "qwen2.5-1.5b, qwen3-1.7b, gemma3-1b, llama3.2-3b, llama3.1-8b)")
    p.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, cuda:N, or auto (default: cpu)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="the model's dtype (default: float32)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=None, help="override the workload's request count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baselines", help="comma-separated plain-transformers modes: sequential, padded, hf_continuous "
                                       "(default: by workload and recipe)")
    p.add_argument("--json", help="write the result JSON here")
    p.add_argument("--plot", help="write a PNG bar chart here (needs infopt[bench])")
    p.add_argument("--csv", help="append a row to this history CSV")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="print B/A ratios of two results")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(fn=_run)
