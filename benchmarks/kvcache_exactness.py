"""Greedy token identity on the default model: plain generate vs each lossless cache layout and attention backend.

10 prompts x 64 new tokens (fp32), one batch-1 call per prompt. The paged cache runs twice over the
prompts, which share a chat template prefix, so the second pass is served with prefix-cache hits.

Usage: python benchmarks/kvcache_exactness.py [--prompts 10] [--tokens 64] [--json out.json]
"""

import argparse
import json
import time

import torch

import infopt
from infopt.attention import Attention
from infopt.kvcache import Paged, Static, paged_pool
from infopt.models import load_default

p = argparse.ArgumentParser()
p.add_argument("--prompts", type=int, default=10)
p.add_argument("--tokens", type=int, default=64)
p.add_argument("--json", default=None)
args = p.parse_args()

model, tok = load_default()
questions = ["What is a Python generator?", "Explain the with statement.", "How do I sort a list of tuples?",
             "What does the GIL do?", "Write a haiku about the sea.", "Who wrote Hamlet?",
             "Give three uses of a hash map.", "What is recursion?", "How does HTTP caching work?",
             "Summarize the water cycle."]
prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_tensors="pt",
                                   return_dict=True)["input_ids"] for q in (questions * 2)[: args.prompts]]


def run(m):
    return [m.generate(ids, max_new_tokens=args.tokens, do_sample=False)[0, ids.shape[1]:].tolist() for ids in prompts]


t0 = time.perf_counter()
ref = run(model)
rows = {}
for name, recipe in [("attention eager", [Attention("eager")]), ("attention sdpa", [Attention("sdpa")]),
                     ("attention paged", [Attention("paged")]), ("kvcache static", [Static()]),
                     ("kvcache paged (cold)", [Paged()])]:
    infopt.optimize(model, recipe)
    out = run(model)
    rows[name] = sum(a == b for a, b in zip(out, ref, strict=True))
    if name.startswith("kvcache paged"):
        pool = paged_pool(model)
        out2 = run(model)  # the same prompts again: prefix-cache hits
        rows["kvcache paged (prefix hits)"] = sum(a == b for a, b in zip(out2, ref, strict=True))
        rows["paged allocator after the calls"] = pool.allocator.stats()
    infopt.undo(model)
    print(f"{name}: {rows[name]}/{len(prompts)} prompts token-identical", flush=True)
print(f"kvcache paged (prefix hits): {rows['kvcache paged (prefix hits)']}/{len(prompts)} prompts token-identical")
result = {"prompts": len(prompts), "new_tokens": args.tokens, "identical": rows, "seconds": time.perf_counter() - t0,
          "torch": torch.__version__}
print(json.dumps(result, indent=2, default=str))
if args.json:
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2, default=str)
