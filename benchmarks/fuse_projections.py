"""Fused q/k/v and gate/up projections (``Compile(fuse_projections=...)``) against separate ones: batch-1 decode.

For each dtype, the default model with a static cache and a compiled decode step (``mode="default"`` on CPU,
``"reduce-overhead"``, i.e. CUDA graphs, on CUDA), with the projections fused and not, in alternating rounds in
one process; decode tokens/s is ``(n - 1) / (t(n) - t(1))`` per round, the median over rounds is reported, and
the fused model's greedy tokens are compared with the unfused one's.

Usage:
    python benchmarks/fuse_projections.py --dtypes float32 bfloat16 --rounds 2 --json out.json
    python benchmarks/fuse_projections.py --device cuda --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import infopt
from infopt.bench.harness import machine_info
from infopt.models import load_default


def rate(model, ids, n: int, device: str) -> tuple[float, torch.Tensor]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    kw = dict(do_sample=False)
    sync()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, **kw)
    sync()
    t1 = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
    sync()
    return (n - 1) / (time.perf_counter() - t0 - t1), out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="timed generates per model per round")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    mode = "reduce-overhead" if args.device == "cuda" else "default"
    rows = []
    for name in args.dtypes:
        dtype = getattr(torch, name)
        rates: dict[bool, list[float]] = {False: [], True: []}
        outs: dict[bool, torch.Tensor] = {}
        for _ in range(args.rounds):
            for fuse in (False, True):
                model, tok = load_default(dtype=dtype, device=args.device)
                ids = tok("The quick brown fox jumps over the lazy dog. Then", return_tensors="pt").input_ids.to(args.device)
                infopt.optimize(model, [{"kvcache": {"kind": "static"}},
                                        {"compile": {"mode": mode, "fuse_projections": fuse}}])
                rate(model, ids, args.tokens, args.device)  # warm
                for _ in range(args.repeats):
                    r, outs[fuse] = rate(model, ids, args.tokens, args.device)
                    rates[fuse].append(r)
                del model
        row = {"dtype": name, "device": args.device, "mode": mode,
               "separate_tok_s": round(statistics.median(rates[False]), 1),
               "fused_tok_s": round(statistics.median(rates[True]), 1),
               "samples": {"separate": [round(x, 1) for x in rates[False]], "fused": [round(x, 1) for x in rates[True]]},
               "greedy_identical": bool(torch.equal(outs[False], outs[True]))}
        row["ratio"] = round(row["fused_tok_s"] / row["separate_tok_s"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": machine_info(args.device), "tokens": args.tokens, "rounds": args.rounds,
                           "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
