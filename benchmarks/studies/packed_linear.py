"""fp32 linear at decode widths: ``F.linear`` (MKL on x86 builds) against oneDNN's inner product on a weight
prepacked once (``infopt.compile.packed``), on the default model's layer shapes.

Run on a quiet machine: python benchmarks/studies/packed_linear.py [--rows 1 2 8 16] [--repeats 50]
"""

import argparse
import statistics
import time

import torch
from torch import nn

from infopt.compile.packed import pack_linears_
from infopt.ops.packed_linear import can_pack

parser = argparse.ArgumentParser()
parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 16])
parser.add_argument("--repeats", type=int, default=50)
args = parser.parse_args()

# SmolLM2-135M: q/o 576x576, k/v 576x192, gate/up 576x1536, down 1536x576, head 576x49152
SHAPES = {"q/o": (576, 576), "k/v": (576, 192), "gate/up": (576, 1536), "down": (1536, 576), "head": (576, 49152)}
PER_LAYER = {"q/o": 2, "k/v": 2, "gate/up": 2, "down": 1}


def median_us(fn) -> float:
    for _ in range(5):
        fn()
    ts = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


if not can_pack():
    raise SystemExit("this torch build has no oneDNN prepacked linear")
torch.manual_seed(0)
print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
print("| rows | layer | F.linear us | packed us | ratio |")
print("|---|---|---|---|---|")
for rows in args.rows:
    layer = {"plain": 0.0, "packed": 0.0}
    for name, (k, n) in SHAPES.items():
        lin = nn.Linear(k, n, bias=False)
        x = torch.randn(rows, k)
        with torch.no_grad():
            plain = median_us(lambda lin=lin, x=x: lin(x))
            pack_linears_(lin, min_elements=0)
            packed = median_us(lambda lin=lin, x=x: lin(x))
        if name in PER_LAYER:
            layer["plain"] += plain * PER_LAYER[name]
            layer["packed"] += packed * PER_LAYER[name]
        print(f"| {rows} | {name} {k}x{n} | {plain:.0f} | {packed:.0f} | {plain / packed:.2f}x |")
    print(f"| {rows} | one decoder layer (7 linears) | {layer['plain']:.0f} | {layer['packed']:.0f} | "
          f"{layer['plain'] / layer['packed']:.2f}x |")
