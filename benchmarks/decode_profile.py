"""Where one decode token's time goes on the default model: torch.profiler over greedy generate, per recipe.

Usage:
    python benchmarks/decode_profile.py [--tokens 64] [--recipe cpu-fast|none|FILE.yaml] [--json out.json]

Prints the top operators by self CPU time, then a per-token breakdown into categories (weight
matmuls, attention, compiled fused kernels and their wrapper, dynamo's guard check, other eager
operators) and the weight bandwidth achieved: weight bytes read per token x tokens/s (timed without
the profiler) against the machine's measured copy bandwidth. Run on a quiet machine.
"""

import argparse
import json
import statistics
from pathlib import Path

import torch
from _common import decode_rate  # this folder: the shared timing helpers
from torch.profiler import ProfilerActivity, profile

import infopt
from infopt.bench.harness import measure_bandwidth, weight_bytes_per_token
from infopt.models import load_default

CATEGORIES = {  # first match wins; keys are substrings of profiler event names
    "weight matmuls": ("_weight_int4pack_mm", "int4mm_packed_weight", "_weight_int8pack_mm", "infopt::int4_a8_linear",
                       "infopt::int8_a8_linear", "infopt::int8_f32_linear", "infopt::w8a8_linear", "aten::mm",
                       "aten::addmm", "_int_mm", "aten::bmm"),
    "attention": ("scaled_dot_product", "flash_attention", "infopt::paged_attention"),
    "dynamo guards": ("TorchDynamo Cache Lookup", "Pregraph bytecode"),
    "compiled kernels + wrapper": ("CompiledFxGraph", "Torch-Compiled Region", "AOTDispatcher"),
}
CONTAINERS = ("aten::linear", "aten::matmul", "quantized::int4mm_packed_weight_cpu", "Torch-Compiled Region")

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, default=64)
p.add_argument("--recipe", default=None, help="preset name, recipe file, or none")
p.add_argument("--repeats", type=int, default=3, help="timed generates (without the profiler)")
p.add_argument("--json", default=None)
args = p.parse_args()

model, tok = load_default()
if args.recipe and args.recipe != "none":
    infopt.optimize(model, args.recipe)
ids = tok("The history of the Roman empire", return_tensors="pt").input_ids
n = args.tokens
kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False)
model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up

rates = [decode_rate(model, ids, n)[0] for _ in range(args.repeats)]
rate = statistics.median(rates)

with profile(activities=[ProfilerActivity.CPU]) as prof:
    model.generate(ids, **kw)
events = prof.key_averages()
total = sum(e.self_cpu_time_total for e in events)
by_cat = {c: 0.0 for c in CATEGORIES}
by_cat["other eager operators"] = 0.0
for e in events:
    cat = next((c for c, keys in CATEGORIES.items() if any(k in e.key for k in keys)), "other eager operators")
    by_cat[cat] += e.self_cpu_time_total
ops = sum(e.count for e in events if not any(k in e.key for k in CONTAINERS))
print(events.table(sort_by="self_cpu_time_total", row_limit=15))

wbytes = weight_bytes_per_token(model)
bw = measure_bandwidth()
summary = {
    "recipe": args.recipe or "none",
    "tokens": n,
    "threads": torch.get_num_threads(),
    "decode_tokens_per_s": round(rate, 2),
    "decode_tokens_per_s_runs": [round(r, 2) for r in rates],
    "profiled_ms_per_token": round(total / 1e3 / n, 3),
    "ms_per_token_by_category": {c: round(v / 1e3 / n, 3) for c, v in by_cat.items()},
    "profiler_events_per_token": round(ops / n, 1),
    "weight_mb_per_token": round(wbytes / 1e6, 1),
    "weight_bandwidth_gbs": round(wbytes * rate / 1e9, 2),
    "machine_copy_bandwidth_gbs": round(bw, 2),
}
print(json.dumps(summary, indent=2))
if args.json:
    Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
