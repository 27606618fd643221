"""Decode tokens/s of the default model's int4 recipe under each compile option, one process per variant.

Usage: python benchmarks/compile_options.py [--variants eager sdpa gqa max-autotune cpp-wrapper] [--json out.json]

Every variant is int4 weights (group 32, int8 head) + a static KV cache, and differs only in how
the decode step runs:

| variant | decode step |
|---|---|
| eager | not compiled |
| sdpa | compiled, attention left on transformers' SDPA (K/V heads repeated per query group) |
| gqa | compiled, attention ``sdpa_gqa`` (what ``Compile`` selects on CPU): the ``cpu-fast`` step |
| max-autotune | as gqa, ``mode: max-autotune`` |
| cpp-wrapper | as gqa, ``cpp_wrapper: true`` |

Each variant runs in a fresh process (a clean compile state); ``--cold`` also gives it an empty inductor
on-disk cache, so the compile seconds are those of a first compile. The script prints compile seconds
and the median decode tokens/s of 5 timed 128-token generates. Run it on a quiet machine.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {
    "eager": ([{"attention": {"backend": "sdpa_gqa"}}], None),
    "sdpa": ([{"attention": {"backend": "sdpa"}}], {"mode": "default"}),
    "gqa": ([], {"mode": "default"}),
    "max-autotune": ([], {"mode": "max-autotune"}),
    "cpp-wrapper": ([], {"mode": "default", "cpp_wrapper": True}),
}

CHILD = r'''
import json, statistics, sys, time
import torch
import infopt
from infopt.compile import Compile, compile_stats
from infopt.compile.decoder import CompiledForwards
from infopt.generate import set_part
from infopt.models import load_default

pre, comp = json.loads(sys.argv[1])
model, tok = load_default()
steps = pre + [{"quantize": {"method": "int4", "group_size": 32, "include_lm_head": True}}, {"kvcache": {"kind": "static"}}]
if comp is not None and not pre:
    steps.append({"compile": comp})
infopt.optimize(model, steps)
if comp is not None and pre:  # compiled, but keep the attention backend the recipe chose
    set_part(model, "forwards", CompiledForwards(Compile(**comp)), step="compile")
ids = tok("The history of the Roman empire, told briefly:", return_tensors="pt").input_ids
t0 = time.perf_counter()
model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
warm = time.perf_counter() - t0
n = 128
def rate():
    t0 = time.perf_counter(); model.generate(ids, max_new_tokens=1, do_sample=False); t1 = time.perf_counter() - t0
    t0 = time.perf_counter(); model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return (n - 1) / (time.perf_counter() - t0 - t1)
runs = [rate() for _ in range(5)]
stats = compile_stats(model)
print(json.dumps({"attention": model.config._attn_implementation, "decode_tokens_per_s": round(statistics.median(runs), 1),
                  "runs": [round(r, 1) for r in runs],
                  "compile_seconds": round(stats.seconds if stats else 0.0, 1), "first_call_seconds": round(warm, 1)}))
'''

p = argparse.ArgumentParser()
p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
p.add_argument("--cold", action="store_true",
               help="give each variant an empty inductor cache, so compile seconds are a first compile's")
p.add_argument("--json", default=None)
args = p.parse_args()
results = {}
for v in args.variants:
    env = dict(os.environ)
    if args.cold:
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="infopt-inductor-")
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(VARIANTS[v])], capture_output=True, text=True,
                         env=env)
    if out.returncode != 0:
        raise SystemExit(f"{v} failed:\n{out.stderr[-3000:]}")
    results[v] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{v:13s} {results[v]['decode_tokens_per_s']:6.1f} tok/s  (runs {results[v]['runs']}, "
          f"compile {results[v]['compile_seconds']} s, attention {results[v]['attention']})", flush=True)
if args.json:
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
