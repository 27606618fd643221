"""``infopt tune``: search recipes for a workload and a quality gate on this machine."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..models import load_model
from ..tuner.search import tune
from .bench import DTYPES, resolve_device

__all__ = ["register"]


def _run(args) -> int:
    device = resolve_device(args.device)
    model, tok = load_model(args.model, dtype=getattr(torch, args.dtype), device=device)
    if tok is None:
        raise FileNotFoundError(f"{args.model} has no tokenizer; the benchmark workloads need one")
    result = tune(model, tok, args.workload, gate=args.gate, budget_s=args.budget,
                  candidates=args.candidates.split(",") if args.candidates else None, calibrated=args.calibrated,
                  repeats=args.repeats, num_requests=args.requests, seed=args.seed, progress=not args.quiet)
    print(result)
    if result.recipe is not None:
        print("\n" + result.recipe.to_yaml().rstrip())
    if args.save and result.recipe is not None:
        print(f"\nwrote {result.save_yaml(args.save)}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=2, default=str))
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {result.plot(args.plot)}")
    return 0 if result.recipe is not None else 1


def register(sub) -> None:
    from ..bench.workloads import WORKLOADS  # infopt.bench is not loaded by import infopt

    p = sub.add_parser("tune", help="find the fastest recipe within a quality gate on this machine")
    p.add_argument("--workload", default="decode", choices=list(WORKLOADS))
    p.add_argument("--gate", default="lossless", help="'lossless' or limits such as max_kl=0.02[,min_top1=0.98]")
    p.add_argument("--budget", type=float, default=1800.0, help="seconds the search may take (default: 1800)")
    p.add_argument("--model", default="default", help="'default', a local HF folder, or 'random:FAMILY'")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default: cpu)")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--candidates", help="comma-separated presets or recipe files to try instead of the defaults")
    p.add_argument("--calibrated", action="store_true", help="also try GPTQ and AWQ (minutes each, calibrated once)")
    p.add_argument("--repeats", type=int, default=2, help="timed repeats per candidate (default: 2)")
    p.add_argument("--requests", type=int, default=None, help="override the workload's request count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", help="write the best recipe as YAML here")
    p.add_argument("--plot", help="write the speed-against-KL chart (PNG) here (needs infopt[bench])")
    p.add_argument("--json", help="write every candidate's figures here")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(fn=_run)
