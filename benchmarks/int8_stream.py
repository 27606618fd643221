"""The int8 weight-only kernels streaming one decode token's weights: every projection of the default model's 30
layers plus the output head (134 MB of int8 codes, far more than the caches), one activation row, in order.

Rows, interleaved round by round in one process: ``infopt::int8_f32_linear`` (fp32 activations and sums) with one
scale per row and with 32- and 64-channel groups, and ``torch._weight_int8pack_mm`` (bf16 activations, one scale
per row). Prints milliseconds per token and the weight bytes read per second; ``--no-head`` leaves the head out.

With ``--rows M [M ...]`` it compares instead, for activations of M rows (prompts), the int8 x fp32 kernel against an
fp32 GEMM over the weight dequantized a chunk of rows at a time (the path without the C++ kernels).

Usage: python benchmarks/int8_stream.py [--rounds 6] [--no-head] [--rows M ...] [--json out.json]
"""

import argparse
import json
import statistics
import time

import torch

from infopt.bench.harness import machine_info, measure_bandwidth
from infopt.quantize.formats import a8

p = argparse.ArgumentParser()
p.add_argument("--rounds", type=int, default=6)
p.add_argument("--no-head", action="store_true")
p.add_argument("--rows", type=int, nargs="*", default=None)
p.add_argument("--json", default=None)
args = p.parse_args()
if not a8.available():
    raise SystemExit("the C++ kernels are not built here (see `infopt doctor`)")

torch.manual_seed(0)
hidden, inter, kv = 576, 1536, 192
shapes = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden),
          (hidden, inter)] * 30 + ([] if args.no_head else [(49152, hidden)])
codes = [torch.randint(-127, 128, s, dtype=torch.int8) for s in shapes]
row_scales = [torch.rand(s[0]) / 100 + 1e-3 for s in shapes]
x = {k: torch.randn(1, k) for k in (hidden, inter)}
xb = {k: v.bfloat16() for k, v in x.items()}
nbytes = sum(c.numel() for c in codes)
f32 = torch.ops.infopt.int8_f32_linear


def grouped(g):
    return [s[:, None].expand(-1, c.shape[1] // g).contiguous() for c, s in zip(codes, row_scales, strict=True)]


if args.rows:
    from infopt.quantize.formats.int8_layouts import _dequantized_matmul

    out = []
    for m in args.rows:
        xm = {k: torch.randn(m, k) for k in (hidden, inter)}
        runs = {"int8_f32_linear": [], "chunked dequantize + fp32 GEMM": []}
        for r in range(args.rounds):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                fn = f32 if name == "int8_f32_linear" else _dequantized_matmul
                t0 = time.perf_counter()
                for c, s in zip(codes, row_scales, strict=True):
                    fn(xm[c.shape[1]], c, s)
                runs[name].append(time.perf_counter() - t0)
        row = {"rows": m, **{name: statistics.median(v) * 1e3 for name, v in runs.items()}}
        out.append(row)
        print(f"{m:5d} rows: " + "  ".join(f"{k} {v:8.1f} ms" for k, v in row.items() if k != "rows"), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "threads": torch.get_num_threads(), "rows": out}, f, indent=1)
    raise SystemExit(0)

cases = {
    "int8_f32_linear, per row": (f32, x, row_scales),
    "int8_f32_linear, g64": (f32, x, grouped(64)),
    "int8_f32_linear, g32": (f32, x, grouped(32)),
    "_weight_int8pack_mm (bf16), per row": (torch._weight_int8pack_mm, xb, [s.bfloat16() for s in row_scales]),
}
times = {name: [] for name in cases}
for r in range(args.rounds):
    for name, (op, xs, scales) in (list(cases.items()) if r % 2 == 0 else list(cases.items())[::-1]):
        for c, s in zip(codes, scales, strict=True):
            op(xs[c.shape[1]], c, s)
        t0 = time.perf_counter()
        for _ in range(10):
            for c, s in zip(codes, scales, strict=True):
                op(xs[c.shape[1]], c, s)
        times[name].append((time.perf_counter() - t0) / 10)
copy = measure_bandwidth()
rows = []
print(f"{len(codes)} matrices, {nbytes / 1e6:.1f} MB of codes per token; copy bandwidth {copy:.1f} GB/s (read + write)")
for name, ts in times.items():
    t = statistics.median(ts)
    rows.append({"kernel": name, "ms_per_token": t * 1e3, "gbs": nbytes / t / 1e9, "runs_ms": [v * 1e3 for v in ts]})
    print(f"{name:38} {t * 1e3:6.2f} ms/token  {nbytes / t / 1e9:5.1f} GB/s")
if args.json:
    with open(args.json, "w") as f:
        json.dump({"machine": machine_info(), "threads": torch.get_num_threads(), "bytes_per_token": nbytes,
                   "copy_gbs": copy, "rows": rows}, f, indent=1)
