"""One linear layer, batch 1: fp32 matmul vs torch._weight_int8pack_mm with fp32 and bf16 activations.

Usage: python benchmarks/studies/int8_kernel.py [--out 1536 --in 576]   (SmolLM2's MLP shape by default)
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from infopt.quantize.formats.int8 import quantize_int8_per_channel

p = argparse.ArgumentParser()
p.add_argument("--out", type=int, default=1536)
p.add_argument("--in", dest="inp", type=int, default=576)
p.add_argument("--iters", type=int, default=2000)
args = p.parse_args()

torch.manual_seed(0)
x = torch.randn(1, args.inp)
w = torch.randn(args.out, args.inp)
q, s = quantize_int8_per_channel(w)


def us(fn) -> float:
    fn()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(args.iters):
            fn()
        runs.append((time.perf_counter() - t0) / args.iters * 1e6)
    return statistics.median(runs)


xb, sb = x.to(torch.bfloat16), s.to(torch.bfloat16)
print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; [{args.out}, {args.inp}] weight, batch 1, median of 5")
print(f"fp32 F.linear:                    {us(lambda: F.linear(x, w)):7.1f} us")
print(f"int8pack_mm, fp32 activations:    {us(lambda: torch._weight_int8pack_mm(x, q, s)):7.1f} us")
print(f"int8pack_mm, bf16 activations:    {us(lambda: torch._weight_int8pack_mm(xb, q, sb)):7.1f} us")
