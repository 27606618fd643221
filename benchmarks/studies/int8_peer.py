"""infopt's int8/int4 decode against PyTorch's own dynamic int8 quantization, in one run on the default model.

torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, torch.qint8) swaps every nn.Linear (the tied head
included) for an fbgemm dynamic-quantized one: int8 weights and per-batch int8 activations. Greedy batch 1,
a 32-token prompt, --tokens new tokens; medians of --repeats runs, interleaved.

Usage: python benchmarks/studies/int8_peer.py [--tokens 64] [--repeats 3] [--json out.json]
"""

import argparse
import copy
import json
import statistics
import time

import torch
from torch import nn

import infopt
from infopt.eval import evaluate, make_reference
from infopt.models import load_default
from infopt.quantize import Int4WeightOnly, Int8WeightOnly

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, default=64)
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--json", default=None)
args = p.parse_args()

base, tok = load_default()
ids = tok("The history of the Roman empire is", return_tensors="pt").input_ids
ref = make_reference(base, tokenizer=tok, max_tokens=512, dtype="float32")

peer = torch.ao.quantization.quantize_dynamic(copy.deepcopy(base), {nn.Linear}, torch.qint8)
int8 = infopt.optimize(copy.deepcopy(base), [Int8WeightOnly(include_lm_head=True)])
int4 = infopt.optimize(copy.deepcopy(base), [Int4WeightOnly(group_size=32, include_lm_head=True)])
models = {"hf fp32": base, "quantize_dynamic int8": peer, "infopt int8 (+head)": int8,
          "infopt int4 g32 (+int8 head)": int4}


def tok_s(m):
    t = time.perf_counter()
    m.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
    return args.tokens / (time.perf_counter() - t)


for m in models.values():
    m.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
runs = {k: [] for k in models}
for _ in range(args.repeats):
    for k, m in models.items():
        runs[k].append(tok_s(m))
rows = {}
for k, m in models.items():
    q = evaluate(m, ref) if m is not base else None
    rows[k] = {"tokens_per_s": statistics.median(runs[k]),
               "ratio": statistics.median(runs[k]) / statistics.median(runs["hf fp32"]),
               "kl": q.kl if q else 0.0, "top1": q.top1 if q else 1.0}
    print(f"{k:<30} {rows[k]['tokens_per_s']:6.1f} tok/s  {rows[k]['ratio']:.2f}x  KL {rows[k]['kl']:.4f}  "
          f"top-1 {rows[k]['top1']:.3f}", flush=True)
if args.json:
    with open(args.json, "w") as f:
        json.dump({"tokens": args.tokens, "repeats": args.repeats, "rows": rows}, f, indent=2)
