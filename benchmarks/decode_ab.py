"""Batch-1 greedy decode of recipes against plain transformers, interleaved in one process.

Every model (plain fp32 first, then one per recipe) is loaded into the same process; each round times one
``generate`` of ``--tokens`` new tokens per model, in alternating order from round to round, and the ratios are taken
within a round. On a small, shared machine the speed of the host moves by a quarter within minutes, so ratios from
separate processes (``infopt bench`` runs baseline and optimized minutes apart) can move by as much; interleaved
rounds share the moment. The time of the prompt (a one-token ``generate``, timed just before) is subtracted.

Usage:
    python benchmarks/decode_ab.py RECIPE [RECIPE ...] [--rounds 6] [--tokens 128] [--json out.json]

RECIPE: a preset name or a recipe file. Also checks that each recipe's greedy tokens are those of its first round, and
says whether they are those of plain transformers (what a lossless recipe must give).
"""

import argparse
import json
import statistics

import torch
from _common import decode_rate  # this folder: the shared timing helpers

import infopt
from infopt.bench.harness import machine_info
from infopt.models import load_default

p = argparse.ArgumentParser()
p.add_argument("recipes", nargs="+")
p.add_argument("--rounds", type=int, default=6)
p.add_argument("--tokens", type=int, default=128)
p.add_argument("--json", default=None)
args = p.parse_args()

models = {}
for name in ["transformers fp32", *args.recipes]:
    model, tok = load_default()
    if name != "transformers fp32":
        infopt.optimize(model, name)
    models[name] = model
ids = tok("The history of the Roman empire, told briefly:", return_tensors="pt").input_ids
for model in models.values():  # warm-up (and compiles, for recipes that compile)
    model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)

rates = {name: [] for name in models}
first, stable = {}, {name: True for name in models}
n = args.tokens
for r in range(args.rounds):
    order = list(models.items()) if r % 2 == 0 else list(models.items())[::-1]
    for name, model in order:
        rate, out = decode_rate(model, ids, n)
        rates[name].append(rate)
        first.setdefault(name, out)
        stable[name] &= torch.equal(out, first[name])

rows = []
base = rates["transformers fp32"]
for name, rs in rates.items():
    ratios = [a / b for a, b in zip(rs, base, strict=True)]
    rows.append({"recipe": name, "tokens_per_s": statistics.median(rs), "runs": rs,
                 "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                 "same_tokens_every_round": stable[name],
                 "same_tokens_as_transformers": torch.equal(first[name], first["transformers fp32"])})
    print(f"{name:40} {statistics.median(rs):7.1f} tokens/s   x{statistics.median(ratios):.2f} "
          f"(rounds {min(ratios):.2f}-{max(ratios):.2f})"
          f"{'' if rows[-1]['same_tokens_as_transformers'] else '   (greedy tokens differ from transformers)'}",
          flush=True)
if args.json:
    with open(args.json, "w") as f:
        json.dump({"machine": machine_info(), "threads": torch.get_num_threads(), "new_tokens": n,
                   "rounds": args.rounds, "rows": rows}, f, indent=1)
