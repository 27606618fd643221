"""Start-up: how long ``infopt.load`` of a saved optimized model takes until its first generated token.

Usage: python benchmarks/startup.py [--recipe cpu-fast] [--rounds 2] [--json out.json]

Optimizes the default model with the recipe, saves it with ``infopt.save_optimized``, then starts fresh Python
processes that each import infopt, ``infopt.load`` the folder and generate one token from a short prompt, in four
kinds, alternated in each round:

- ``default, cold``: ``infopt.load(folder)`` (the folder's compiled steps unused) with empty compile caches
  (``TORCHINDUCTOR_CACHE_DIR`` and ``INFOPT_CACHE_DIR`` new temporary folders, but for infopt's C++ kernels, which the
  set-up builds): a new machine, every step built;
- ``default, warm``: the same with the caches the round's cold process filled: the user's own caches;
- ``trusted, cold`` / ``trusted, warm``: ``infopt.load(folder, trust_compiled=True)``, which runs the folder's steps.

Each process reports its own phases: import, load (build, re-apply the recipe, read the weights, build or load the
steps), first token; and the whole process's wall time; then the decode speed of the loaded step (64 tokens, the
first-token time subtracted) and how its steps came (loaded, as AOTInductor packages, from the package index,
compiled). Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import empty_caches

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
import infopt
t1 = time.perf_counter()
model, tok = infopt.load(sys.argv[1], trust_compiled=sys.argv[2] == "1")
t2 = time.perf_counter()
ids = tok("The capital of France is", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=1, do_sample=False)
t3 = time.perf_counter()
from infopt.compile import compile_stats
stats = compile_stats(model)
t4 = time.perf_counter()
model.generate(ids, max_new_tokens=65, min_new_tokens=65, do_sample=False)  # then 64 tokens: the loaded step's speed
rate = 64 / (time.perf_counter() - t4 - (t3 - t2))
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "first_token_s": t3 - t2, "load_to_token_s": t3 - t1,
                  "token": int(out[0, -1]), "decode_tokens_per_s_after": rate,
                  "steps": {k: getattr(stats, k) for k in ("loaded", "aot", "aot_indexed", "compiles")} if stats else None}))
"""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--recipe", default="cpu-fast")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the four kinds of start")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import infopt
    from infopt.bench.harness import machine_info
    from infopt.core.caches import cache_dir as kind_dir
    from infopt.models import load_default

    work = Path(tempfile.mkdtemp(prefix="infopt-startup-"))
    model, tok = load_default()
    t0 = time.perf_counter()
    infopt.optimize(model, args.recipe)
    optimize_s = time.perf_counter() - t0
    folder = infopt.save_optimized(model, work / "model", tokenizer=tok)
    size_mb = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e6
    del model
    runs = []
    for round_ in range(args.rounds):
        for trust in (False, True):
            # empty compile caches (Inductor's, and infopt's AOTInductor packages) for the cold process: a new machine;
            # the warm one after it finds what the cold one built
            env = empty_caches(work / f"caches-{round_}-{int(trust)}", kind_dir("extensions"))
            for cache in ("cold", "warm"):
                t = time.perf_counter()
                out = subprocess.run([sys.executable, "-c", CHILD, str(folder), "1" if trust else "0"],
                                     capture_output=True, text=True, env=env)
                wall = time.perf_counter() - t
                if out.returncode:
                    sys.exit(f"run failed:\n{out.stderr[-3000:]}")
                r = json.loads(out.stdout.strip().splitlines()[-1])
                r.update(round=round_, trust_compiled=trust, cache=cache, process_wall_s=wall)
                runs.append(r)
                print(f"{'trusted' if trust else 'default'}, {cache:>4}: import {r['import_s']:.1f} s, load "
                      f"{r['load_s']:.1f} s, first token {r['first_token_s']:.1f} s; load to first token "
                      f"{r['load_to_token_s']:.1f} s (process {wall:.1f} s); then "
                      f"{r['decode_tokens_per_s_after']:.0f} tokens/s; steps {r['steps']}", flush=True)
    summary = {}
    for trust in (False, True):
        for cache in ("cold", "warm"):
            got = sorted(r["import_s"] + r["load_to_token_s"] for r in runs
                         if r["trust_compiled"] == trust and r["cache"] == cache)
            summary[f"{'trusted' if trust else 'default'}-{cache}"] = got[len(got) // 2]
    print("median seconds from process start to the first token:", json.dumps(summary))
    result = {"machine": machine_info(), "recipe": args.recipe, "optimize_s": optimize_s, "folder_mb": size_mb,
              "start_to_first_token_median_s": summary, "runs": runs,
              "command": f"python benchmarks/startup.py --recipe {args.recipe} --rounds {args.rounds}"}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
