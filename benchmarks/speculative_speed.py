"""Quick speed check of speculative recipes against plain greedy generate, interleaved in one process.

Lighter than ``infopt bench`` (no quality pass, fewer repeats) for steering the design; the figures in
docs/speculative.md come from ``infopt bench``.

Run: flock /tmp/infopt-bench.lock python benchmarks/speculative_speed.py --workload grounded --requests 2 \
         --recipe benchmarks/recipes/spec-lookup.yaml
"""

import argparse
import statistics
import time

import torch

import infopt
from infopt.bench.workloads import make_workload
from infopt.models import load_default
from infopt.speculative import stats

parser = argparse.ArgumentParser()
parser.add_argument("--workload", default="grounded")
parser.add_argument("--requests", type=int, default=2)
parser.add_argument("--new", type=int, default=None, help="override max_new_tokens")
parser.add_argument("--repeats", type=int, default=2)
parser.add_argument("--recipe", action="append", required=True)
args = parser.parse_args()

model, tok = load_default()
reqs = make_workload(args.workload, tok, num_requests=args.requests)
pad = tok.pad_token_id


def run():
    toks, t = [], 0.0
    for r in reqs:
        new = args.new or r.max_new_tokens
        t0 = time.perf_counter()
        out = model.generate(r.input_ids, attention_mask=torch.ones_like(r.input_ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=pad)
        t += time.perf_counter() - t0
        toks.append(out[0, r.prompt_len:].tolist())
    return t, toks


with torch.inference_mode():
    model.generate(reqs[0].input_ids[:, :16], max_new_tokens=4, do_sample=False, pad_token_id=pad)
    rows = {name: [] for name in ["plain"] + args.recipe}
    exact = {}
    for rep in range(args.repeats):
        tb, base = run()
        rows["plain"].append(tb)
        for recipe in args.recipe:
            infopt.optimize(model, recipe)
            try:
                model.generate(reqs[0].input_ids[:, :16], max_new_tokens=4, do_sample=False, pad_token_id=pad)
                t, toks = run()
                rows[recipe].append(tb / t)
                exact[recipe] = toks == base
                st = stats(model)
            finally:
                infopt.undo(model)
            print(f"rep {rep}: {recipe}: speedup {tb / t:.2f}x (plain {tb:.1f}s, spec {t:.1f}s) exact={exact[recipe]} "
                  f"acc={st['acceptance_rate']:.2f} mean_len={st['mean_accepted_length']:.2f} "
                  f"fwd/tok={st['target_forwards_per_token']:.2f}", flush=True)
    for recipe in args.recipe:
        print(f"{recipe}: median speedup {statistics.median(rows[recipe]):.2f}x exact={exact[recipe]}")
