"""Decode speed of the default model against transformers' StaticCache length (why kvcache.Static buckets).

Usage: python benchmarks/studies/static_cache_length.py [--new-tokens 48]
"""

import argparse
import time

import torch
from transformers import StaticCache

from infopt.models import load_default

p = argparse.ArgumentParser()
p.add_argument("--new-tokens", type=int, default=48)
p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048, 4096])
args = p.parse_args()

model, tok = load_default()
ids = tok("def fibonacci(n):", return_tensors="pt")["input_ids"]
n = args.new_tokens


@torch.inference_mode()
def rate(cache=None) -> float:
    kw = {} if cache is None else {"past_key_values": cache}
    model.generate(ids, max_new_tokens=4, do_sample=False, **kw)  # warm-up
    best = float("inf")
    for _ in range(2):
        if cache is not None:
            cache.reset()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)
        best = min(best, time.perf_counter() - t0)
    return n / best


print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {n} new tokens, best of 2")
print(f"dynamic cache: {rate():.1f} tok/s")
for length in args.lengths:
    print(f"static cache {length:>5} slots: {rate(StaticCache(config=model.config, max_cache_len=length)):.1f} tok/s")
