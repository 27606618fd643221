"""Time to first token of int8 weight-only models with fp32 and with bf16 activations, against plain fp32,
alternating in one process (one ``generate(max_new_tokens=1)`` per model per round; medians).

Usage: python benchmarks/studies/int8_ttft.py [--tokens 32 512] [--rounds 5] [--head] [--json out.json]

The prompts are the first N tokens of the embedded evaluation text.
"""

import argparse
import json
import statistics
import time

import torch

import infopt
from infopt.bench.harness import machine_info
from infopt.eval import default_text
from infopt.models import load_default
from infopt.quantize import Int8WeightOnly

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, nargs="+", default=[32, 512])
p.add_argument("--rounds", type=int, default=5)
p.add_argument("--head", action="store_true", help="quantize the output head too")
p.add_argument("--json", default=None)
args = p.parse_args()

models = {"transformers fp32": load_default()[0]}
for name, cd in (("int8, fp32 activations", "float32"), ("int8, bf16 activations", "bfloat16")):
    m, tok = load_default()
    infopt.optimize(m, [Int8WeightOnly(compute_dtype=cd, include_lm_head=args.head)])
    models[name] = m
ids_all = tok(default_text(), return_tensors="pt").input_ids
rows = []
for n in args.tokens:
    ids = ids_all[:, :n]
    for m in models.values():
        m.generate(ids, max_new_tokens=1, do_sample=False)
    times = {name: [] for name in models}
    for r in range(args.rounds):
        for name in (list(models) if r % 2 == 0 else list(models)[::-1]):
            t0 = time.perf_counter()
            models[name].generate(ids, max_new_tokens=1, do_sample=False)
            times[name].append(time.perf_counter() - t0)
    row = {"prompt_tokens": n, **{name: statistics.median(v) * 1e3 for name, v in times.items()}}
    rows.append(row)
    print(f"{n:5d} tokens: " + "  ".join(f"{k} {v:7.1f} ms" for k, v in row.items() if k != "prompt_tokens"),
          flush=True)
if args.json:
    with open(args.json, "w") as f:
        json.dump({"machine": machine_info(), "threads": torch.get_num_threads(), "head": args.head, "rows": rows},
                  f, indent=1)
