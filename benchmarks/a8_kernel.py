"""The int4/int8-weight x int8-activation C++ kernels (``infopt.quantize.formats.a8``) against torch's CPU kernels.

For the default model's layer shapes (and their fused q/k/v and gate/up forms) at 1-8 rows: median time per call,
the weight bandwidth it reaches (weight bytes with their scales / time) and, for reference, the machine's copy
bandwidth measured in the same run. torch's kernels: ``_weight_int4pack_mm_for_cpu`` (bf16 activations, the
``Int4WeightOnly`` layers' kernel) and ``_weight_int8pack_mm`` on bf16 activations (the ``Int8WeightOnly`` head's).

    python benchmarks/a8_kernel.py --json benchmarks/results/a8_kernel.json
"""

import argparse
import json

import torch
from _common import median_time  # this folder: the shared timing helpers

from infopt.bench.harness import machine_info
from infopt.quantize.formats import a8
from infopt.quantize.formats.int4 import quantize_int4_grouped

p = argparse.ArgumentParser()
p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
p.add_argument("--group", type=int, default=32)
p.add_argument("--repeats", type=int, default=7)
p.add_argument("--json", default=None)
args = p.parse_args()

SHAPES = {  # name: (out, in)
    "q/o 576x576": (576, 576), "k/v 192x576": (192, 576), "qkv fused 960x576": (960, 576),
    "gate/up 1536x576": (1536, 576), "gate+up fused 3072x576": (3072, 576), "down 576x1536": (576, 1536),
}
HEAD = (49152, 576)


def timeit(fn, min_s=0.15):
    """Median seconds per call, over ``--repeats`` batches of calls that each last at least ``min_s``."""
    return median_time(fn, runs=args.repeats, min_s=min_s)


def copy_bandwidth():
    src = torch.empty(256 * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), 0.5)
    return 2 * src.numel() / t / 1e9  # read + write


torch.manual_seed(0)
rows = []
print(f"a8 kernel ISA: {a8.isa()}, threads {torch.get_num_threads()}")
bw = copy_bandwidth()
print(f"copy bandwidth (read + write): {bw:.1f} GB/s")
g = args.group
for name, (n, k) in SHAPES.items():
    w = torch.randn(n, k)
    codes, scales, zeros = quantize_int4_grouped(w, g, zero_point="float")
    weight, sm = a8.pack_blocked_int4(codes, scales, zeros)
    tp = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    so = torch.stack([scales.t(), ((8 - zeros) * scales).t()], -1).to(torch.bfloat16).contiguous()
    nbytes = n * k // 2 + n * (k // g) * 4  # codes + bf16 scale and min
    for m in args.rows:
        x = torch.randn(m, k)
        xb = x.to(torch.bfloat16)
        t_torch = timeit(lambda xb=xb, tp=tp, so=so: torch._weight_int4pack_mm_for_cpu(xb, tp, g, so))
        t_a8 = timeit(lambda x=x, weight=weight, sm=sm: torch.ops.infopt.int4_a8_linear(x, weight, sm, g))
        row = {"layer": name, "kind": "int4", "rows": m, "torch_us": t_torch * 1e6, "a8_us": t_a8 * 1e6,
               "a8_gbs": nbytes / t_a8 / 1e9, "torch_gbs": nbytes / t_torch / 1e9, "speedup": t_torch / t_a8}
        rows.append(row)
        print(f"{name:24s} int4 rows {m}: torch {row['torch_us']:7.1f} us ({row['torch_gbs']:5.1f} GB/s)  "
              f"a8 {row['a8_us']:7.1f} us ({row['a8_gbs']:5.1f} GB/s)  x{row['speedup']:.2f}")
n, k = HEAD
codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
scale = torch.rand(n) * 0.01
weight = a8.pack_blocked_int8(codes)
nbytes = n * k + n * 4  # codes (+ 128) and fp32 scales
for m in args.rows:
    x = torch.randn(m, k)
    xb = x.to(torch.bfloat16)  # as Int8Linear calls it (compute_dtype "auto": bf16 activations)
    sb = scale.to(torch.bfloat16)
    t_torch = timeit(lambda xb=xb, sb=sb: torch._weight_int8pack_mm(xb, codes, sb))
    t_a8 = timeit(lambda x=x: torch.ops.infopt.int8_a8_linear(x, weight, scale, g))
    row = {"layer": "head 49152x576", "kind": "int8", "rows": m, "torch_us": t_torch * 1e6, "a8_us": t_a8 * 1e6,
           "a8_gbs": nbytes / t_a8 / 1e9, "torch_gbs": n * k / t_torch / 1e9, "speedup": t_torch / t_a8}
    rows.append(row)
    print(f"{'head 49152x576':24s} int8 rows {m}: torch {row['torch_us']:7.1f} us ({row['torch_gbs']:5.1f} GB/s)  "
          f"a8 {row['a8_us']:7.1f} us ({row['a8_gbs']:5.1f} GB/s)  x{row['speedup']:.2f}")
if args.json:
    with open(args.json, "w") as f:
        json.dump({"machine": machine_info(), "isa": a8.isa(), "group": g, "copy_bandwidth_gbs": bw, "rows": rows},
                  f, indent=1)
