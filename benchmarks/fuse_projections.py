"""Fused q/k/v and gate/up projections (``Compile(fuse_projections=...)``) against separate ones: batch-1 decode.

For each dtype, the default model with a static cache and a compiled decode step (``mode="default"`` on CPU,
``"reduce-overhead"``, i.e. CUDA graphs, on CUDA), with the projections fused and not. Each variant runs in a
process of its own, the two alternating for ``--rounds`` rounds: on the 2-core machine a model optimized second
in one process decoded 5-10% slower than the same model alone, whichever it was. Decode tokens/s is
``(n - 1) / (t(n) - t(1))``, the median of ``--repeats`` per process and the median over rounds reported; the
fused model's greedy tokens are compared with the unfused one's.

Usage:
    python benchmarks/fuse_projections.py --dtypes float32 bfloat16 --rounds 3 --json out.json
    python benchmarks/fuse_projections.py --device cuda --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import torch
from _common import decode_rate  # this folder: the shared timing helpers

import infopt
from infopt.bench.harness import machine_info
from infopt.models import load_default


def rate(model, ids, n: int, device: str) -> tuple[float, torch.Tensor]:
    return decode_rate(model, ids, n, sync=torch.cuda.synchronize if device == "cuda" else None)


def one(args) -> None:
    """One variant in this process: prints one JSON line (tokens/s samples and the greedy output)."""
    mode = "reduce-overhead" if args.device == "cuda" else "default"
    model, tok = load_default(dtype=getattr(torch, args.dtype), device=args.device)
    ids = tok("The quick brown fox jumps over the lazy dog. Then", return_tensors="pt").input_ids.to(args.device)
    infopt.optimize(model, [{"kvcache": {"kind": "static"}},
                            {"compile": {"mode": mode, "fuse_projections": args.one == "fused"}}])
    rate(model, ids, args.tokens, args.device)  # warm
    rates, out = [], None
    for _ in range(args.repeats):
        r, out = rate(model, ids, args.tokens, args.device)
        rates.append(r)
    print("RESULT " + json.dumps({"rates": rates, "tokens": out[0].tolist()}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5, help="timed generates per process")
    p.add_argument("--json", default=None)
    p.add_argument("--one", choices=["separate", "fused"], help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        return one(args)
    mode = "reduce-overhead" if args.device == "cuda" else "default"
    rows = []
    for name in args.dtypes:
        medians: dict[str, list[float]] = {"separate": [], "fused": []}
        outs: dict[str, list[int]] = {}
        for _ in range(args.rounds):
            for variant in ("separate", "fused"):
                cmd = [sys.executable, __file__, "--one", variant, "--dtype", name, "--device", args.device,
                       "--tokens", str(args.tokens), "--repeats", str(args.repeats)]
                res = subprocess.run(cmd, capture_output=True, text=True, check=True)
                line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))
                got = json.loads(line[len("RESULT "):])
                medians[variant].append(statistics.median(got["rates"]))
                outs[variant] = got["tokens"]
        row = {"dtype": name, "device": args.device, "mode": mode,
               "separate_tok_s": round(statistics.median(medians["separate"]), 1),
               "fused_tok_s": round(statistics.median(medians["fused"]), 1),
               "per_process": {k: [round(x, 1) for x in v] for k, v in medians.items()},
               "greedy_identical": outs["separate"] == outs["fused"]}
        row["ratio"] = round(row["fused_tok_s"] / row["separate_tok_s"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": machine_info(args.device), "tokens": args.tokens, "rounds": args.rounds,
                           "repeats": args.repeats, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
