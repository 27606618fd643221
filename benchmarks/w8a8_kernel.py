"""One linear layer: fp32 nn.Linear vs W8A8Linear (int_mm and float paths) vs Int8Linear, SmolLM2-135M's shapes.

Times a call of each layer at m tokens (m = 1: decode, m = 64: a short prefill), median of 5 runs.
W8A8Linear's time includes quantizing the activations per token on every call.

Usage: python benchmarks/w8a8_kernel.py [--tokens 1 64] [--iters 200] [--threads 1] [--json out.json]
"""

import argparse
import json
import platform
import statistics
import time

import torch
from torch import nn

from infopt.quantize.int8 import Int8Linear
from infopt.quantize.w8a8 import W8A8Linear, int_mm_supported

SHAPES = ((576, 576), (576, 1536), (1536, 576))  # (in, out): attention o_proj, MLP up/gate, MLP down

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
p.add_argument("--iters", type=int, default=200, help="calls per run at m=1 (fewer at larger m)")
p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
p.add_argument("--json", default=None, help="append the rows to this JSON file")
args = p.parse_args()
if args.threads:
    torch.set_num_threads(args.threads)


def us(layer: nn.Module, x: torch.Tensor, iters: int) -> float:
    for _ in range(3):
        layer(x)
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            layer(x)
        runs.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(runs)


torch.manual_seed(0)
print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
      f"{torch.backends.cpu.get_cpu_capability()}, {platform.processor() or platform.machine()}; fp32 activations; "
      "median of 5 runs, microseconds per call")
header = f"{'in x out':>11} {'m':>3} | {'fp32':>8} {'w8a8 int_mm':>11} {'w8a8 float':>10} {'int8 bf16':>9} " \
         f"{'int8 fp32':>9} | {'fp32/w8a8':>9}"
print(header)
print("-" * len(header))
rows = []
with torch.inference_mode():
    for in_f, out_f in SHAPES:
        lin = nn.Linear(in_f, out_f, bias=False)
        w8a8 = W8A8Linear.from_float(lin)
        w8a8_float = W8A8Linear.from_float(lin)
        w8a8_float.kernel = "float"
        int8_bf16 = Int8Linear.from_float(lin, compute_dtype="auto")
        int8_fp32 = Int8Linear.from_float(lin, compute_dtype="float32")
        for m in args.tokens:
            x = torch.randn(m, in_f)
            iters = max(10, args.iters // max(1, m // 8))
            ok, _ = int_mm_supported(x.device, m, in_f, out_f)
            t = {
                "fp32": us(lin, x, iters),
                "w8a8_int_mm": us(w8a8, x, iters) if ok else float("nan"),
                "w8a8_float": us(w8a8_float, x, iters),
                "int8_bf16": us(int8_bf16, x, iters),
                "int8_fp32": us(int8_fp32, x, iters),
            }
            w8a8(x)
            row = {"in": in_f, "out": out_f, "m": m, "threads": torch.get_num_threads(), "torch": torch.__version__,
                   "w8a8_kernel": w8a8.last_kernel, **{k: round(v, 1) for k, v in t.items()}}
            rows.append(row)
            print(f"{in_f:>5}x{out_f:<5} {m:>3} | {t['fp32']:8.1f} {t['w8a8_int_mm']:11.1f} {t['w8a8_float']:10.1f} "
                  f"{t['int8_bf16']:9.1f} {t['int8_fp32']:9.1f} | {t['fp32'] / t['w8a8_int_mm']:9.2f}")

if args.json:
    try:
        with open(args.json) as f:
            old = json.load(f)
    except FileNotFoundError:
        old = []
    with open(args.json, "w") as f:
        json.dump(old + rows, f, indent=1)
