"""Where one decode token's time goes on the default model: torch.profiler over greedy generate, per recipe.

Usage: python benchmarks/decode_profile.py [--tokens 32] [--recipe benchmarks/recipes/int4-g32-head8.yaml]
Prints the top operators by self CPU time and the share spent in matmul kernels versus everything else.
Run on a quiet machine.
"""

import argparse
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import infopt
from infopt.models import load_default

MATMUL = ("_weight_int4pack_mm", "_weight_int8pack_mm", "aten::mm", "aten::addmm", "aten::linear", "_int_mm",
          "aten::matmul", "aten::bmm")

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, default=32)
p.add_argument("--recipe", default=None)
p.add_argument("--json", default=None)
args = p.parse_args()

model, tok = load_default()
if args.recipe:
    infopt.optimize(model, args.recipe)
ids = tok("The history of the Roman empire", return_tensors="pt").input_ids
model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
with profile(activities=[ProfilerActivity.CPU]) as prof:
    model.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
events = prof.key_averages()
total = sum(e.self_cpu_time_total for e in events)
mm = sum(e.self_cpu_time_total for e in events if any(k in e.key for k in MATMUL))
calls = sum(e.count for e in events)
print(events.table(sort_by="self_cpu_time_total", row_limit=15))
summary = {
    "recipe": args.recipe or "none", "tokens": args.tokens,
    "ms_per_token": total / 1e3 / args.tokens,
    "matmul_share": mm / total,
    "ops_per_token": calls / args.tokens,
    "us_per_non_matmul_op": (total - mm) / max(1, calls - sum(e.count for e in events if any(k in e.key for k in MATMUL))),
    "threads": torch.get_num_threads(),
}
print(json.dumps(summary, indent=2))
if args.json:
    Path(args.json).write_text(json.dumps(summary, indent=2))
