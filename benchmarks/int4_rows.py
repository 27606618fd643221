"""Time of one int4 layer against the rows (tokens) of its input: the int4 kernels vs a bf16 copy vs fp32.

Usage: python benchmarks/int4_rows.py [--json out.json]

The default model's 576x1536 gate/up shape, group size 32, 2 threads. Why ``Int4WeightOnly(dense_prefill=True)``
switches to the bf16 copy from ``DENSE_MIN_ROWS`` rows: the int4 kernel's time grows with the rows, a bf16
GEMM's barely does. The ``a8`` columns are the integer kernel (int8 activations) and the same layer's prompt path,
which dequantizes the weight on the fly (bf16 and fp32) and runs one GEMM. Median of 5 batches of 30 calls; run on a
quiet machine.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import median_time  # this folder: the shared timing helpers

from infopt.quantize.formats import a8
from infopt.quantize.formats.int4 import Int4Linear

p = argparse.ArgumentParser()
p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
p.add_argument("--json", default=None)
args = p.parse_args()

torch.manual_seed(0)
lin = torch.nn.Linear(576, 1536, bias=False)
q = Int4Linear.from_float(lin, group_size=32)
wb = q.dequantize().to(torch.bfloat16)
qa = Int4Linear.from_float(lin, group_size=32, layout="a8") if a8.available() else None


def ms(fn, n=30) -> float:
    return median_time(fn, calls=n, runs=5, warmup=3) * 1e3


def on_the_fly(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.matmul(x.to(dtype), a8.int4_dense_t(qa.weight_packed, qa.scale_min, 32, dtype)).float()


out = {}
cols = ["int4", "bf16", "fp32"] + (["a8", "a8_dense_bf16", "a8_dense_fp32"] if qa is not None else [])
print(f"{'rows':>5} " + " ".join(f"{c:>13}" for c in cols) + "  (ms)")
for m in args.rows:
    x = torch.randn(m, 576)
    r = {"int4": ms(lambda x=x: q(x)), "bf16": ms(lambda x=x: F.linear(x.to(torch.bfloat16), wb).float()),
         "fp32": ms(lambda x=x: F.linear(x, lin.weight))}
    if qa is not None:
        r["a8"] = ms(lambda x=x: a8.int4_a8_linear(x, qa.weight_packed, qa.scale_min, 32))
        r["a8_dense_bf16"] = ms(lambda x=x: on_the_fly(x, torch.bfloat16))
        r["a8_dense_fp32"] = ms(lambda x=x: on_the_fly(x, torch.float32))
    out[m] = {k: round(v, 3) for k, v in r.items()}
    print(f"{m:>5} " + " ".join(f"{r[c]:>13.3f}" for c in cols), flush=True)
if args.json:
    from infopt.bench.harness import machine_info

    Path(args.json).write_text(json.dumps({"machine": machine_info(), "threads": torch.get_num_threads(),
                                           "a8_isa": a8.isa(), "shape": [576, 1536], "ms": out}, indent=1) + "\n")
