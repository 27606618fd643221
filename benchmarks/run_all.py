"""Run the benchmark scenarios on the embedded default model and append them to benchmarks/results/history.csv.

Usage: python benchmarks/run_all.py [--workloads decode batch] [--recipes none cpu-lossless cpu-fast]
       python benchmarks/run_all.py --recipes benchmarks/recipes/int8.yaml benchmarks/recipes/int4-g32-head8.yaml
Run on a quiet machine: other processes on the same cores distort CPU timings.
"""

import argparse
import json
from pathlib import Path

from infopt.bench import append_csv, format_table, plot, run_bench
from infopt.models import load_default

HERE = Path(__file__).resolve().parent

p = argparse.ArgumentParser()
p.add_argument("--workloads", nargs="+", default=["decode"])
p.add_argument("--recipes", nargs="+", default=["cpu-lossless", "cpu-fast"])
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--requests", type=int, default=None)
args = p.parse_args()

model, tok = load_default()
out = HERE / "results"
out.mkdir(exist_ok=True)
for wl in args.workloads:
    for recipe in args.recipes:
        res = run_bench(model, tok, recipe, wl, repeats=args.repeats, num_requests=args.requests,
                        model_name="SmolLM2-135M-Instruct")
        print(format_table(res), "\n")
        stem = f"{wl}-{Path(recipe).stem if recipe.endswith(('.yaml', '.yml', '.json')) else recipe}"
        (out / f"{stem}.json").write_text(json.dumps(res, indent=2))
        plot(res, out / f"{stem}.png")
        append_csv(res, out / "history.csv")
