"""How long ``infopt.optimize(model, RECIPE)`` keeps a user waiting, per recipe: in a process on a new machine (empty
compile caches) and in the processes after it (the caches that one filled), with the decode speed the applied model
then has and its greedy tokens.

Each recipe gets its own pair of cache folders (``TORCHINDUCTOR_CACHE_DIR`` and ``INFOPT_CACHE_DIR``, infopt's C++
kernels linked in as the set-up builds them); the processes alternate recipes: every recipe's cold process first, then
``--warm`` rounds of warm processes, one per recipe per round. A process loads the default model, applies the recipe
(timed: what a notebook cell or ``infopt.load`` waits for), generates once (any compile a call still waits for shows
in its ``compiles_after_warmup``), then decodes 64 tokens greedily (``_common.decode_rate``).

    python benchmarks/studies/apply_time.py cpu-lossless benchmarks/recipes/cpu-lossless-aot-auto.yaml [--warm 2]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
from _common import empty_caches  # noqa: E402

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[2])  # benchmarks/: the shared timing helpers
from _common import decode_rate
import torch
import infopt
from infopt.compile import compile_stats
from infopt.models import load_default
model, tok = load_default()
ids = tok("The capital of France is", return_tensors="pt").input_ids
t0 = time.perf_counter()
infopt.optimize(model, sys.argv[1])
apply_s = time.perf_counter() - t0
t1 = time.perf_counter()
model.generate(ids, max_new_tokens=1, do_sample=False)
first = time.perf_counter() - t1
rate, out = decode_rate(model, ids, 65)
s = compile_stats(model)
print("RESULT " + json.dumps({"apply_s": apply_s, "first_call_s": first, "decode_tokens_per_s": rate,
      "tokens": out[0, ids.shape[1]:].tolist(),
      "steps": s and {k: getattr(s, k) for k in ("compiles", "aot", "aot_indexed", "compiles_after_warmup",
                                                "cold_eager_calls")}}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipes", nargs="+")
    p.add_argument("--warm", type=int, default=2, help="rounds of warm processes after the cold ones")
    p.add_argument("--json")
    args = p.parse_args()
    from infopt.bench.harness import machine_info
    from infopt.core.caches import cache_dir as kind_dir

    work = Path(tempfile.mkdtemp(prefix="infopt-apply-"))
    envs = {}
    for i, recipe in enumerate(args.recipes):
        envs[recipe] = empty_caches(work / f"caches-{i}", kind_dir("extensions"))
    runs = []
    for round_ in range(1 + args.warm):
        for recipe in args.recipes:
            t = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", CHILD, recipe, str(BENCH)], capture_output=True, text=True,
                                 env=envs[recipe])
            wall = time.perf_counter() - t
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if out.returncode or line is None:
                sys.exit(f"{recipe} failed:\n{out.stderr[-3000:]}")
            r = json.loads(line[len("RESULT "):])
            r.update(recipe=recipe, cache="cold" if round_ == 0 else "warm", round=round_, process_s=wall)
            runs.append(r)
            print(f"{recipe} ({r['cache']}): apply {r['apply_s']:.1f} s, first call {r['first_call_s']:.2f} s, "
                  f"decode {r['decode_tokens_per_s']:.1f} tokens/s, steps {r['steps']}", flush=True)
    summary = {}
    for recipe in args.recipes:
        mine = [r for r in runs if r["recipe"] == recipe]
        warm = [r for r in mine if r["cache"] == "warm"]
        summary[recipe] = {
            "cold_apply_s": mine[0]["apply_s"],
            "warm_apply_s_median": statistics.median(r["apply_s"] for r in warm) if warm else None,
            "decode_tokens_per_s_median": statistics.median(r["decode_tokens_per_s"] for r in mine),
            "compiles_in_calls": sum(r["steps"]["compiles_after_warmup"] for r in mine if r["steps"]),
            "same_tokens_as_first_recipe": all(r["tokens"] == runs[0]["tokens"] for r in mine),
        }
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": machine_info(), "summary": summary, "runs": runs,
            "command": "python benchmarks/studies/apply_time.py " + " ".join(args.recipes) + f" --warm {args.warm}",
        }, indent=1) + "\n")


if __name__ == "__main__":
    main()
