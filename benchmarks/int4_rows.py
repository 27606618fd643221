"""Time of one int4 layer against the rows (tokens) of its input: the int4 kernel vs a bf16 copy vs fp32.

Usage: python benchmarks/int4_rows.py [--json out.json]

The default model's 576x1536 gate/up shape, group size 32, 2 threads. Why ``Int4WeightOnly(dense_prefill=True)``
switches to the bf16 copy from ``DENSE_MIN_ROWS`` rows: the int4 kernel's time grows with the rows, a bf16
GEMM's barely does. Median of 5 batches of 30 calls; run on a quiet machine.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from infopt.quantize.int4 import Int4Linear

p = argparse.ArgumentParser()
p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
p.add_argument("--json", default=None)
args = p.parse_args()

torch.manual_seed(0)
lin = torch.nn.Linear(576, 1536, bias=False)
q = Int4Linear.from_float(lin, group_size=32)
wb = q.dequantize().to(torch.bfloat16)


def ms(fn, n=30) -> float:
    for _ in range(3):
        fn()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e3)
    return statistics.median(runs)


out = {}
print(f"{'rows':>5} {'int4 kernel':>12} {'bf16 copy':>10} {'fp32':>8}  (ms)")
for m in args.rows:
    x = torch.randn(m, 576)
    r = {"int4": ms(lambda x=x: q(x)), "bf16": ms(lambda x=x: F.linear(x.to(torch.bfloat16), wb).float()),
         "fp32": ms(lambda x=x: F.linear(x, lin.weight))}
    out[m] = {k: round(v, 3) for k, v in r.items()}
    print(f"{m:>5} {r['int4']:>12.3f} {r['bf16']:>10.3f} {r['fp32']:>8.3f}", flush=True)
if args.json:
    Path(args.json).write_text(json.dumps({"threads": torch.get_num_threads(), "shape": [576, 1536], "ms": out},
                                          indent=1) + "\n")
