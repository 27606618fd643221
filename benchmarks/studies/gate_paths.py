"""The quality gate's figures on both paths: each recipe applied to the default model with ``optimize(...,
gate={"max_kl": ...})``, and the figures it records (``model.infopt.gate``): the whole-sequence forward over the gate
text (the prompt path) and the decode path (32 greedy tokens teacher-forced through the optimized model's cache and
compiled step), with the seconds the gate's measuring added to the apply (the same recipe applied without a gate,
timed before it).

    python benchmarks/studies/gate_paths.py [--recipes cpu-fast,int8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="cpu-fast")
    p.add_argument("--max-kl", type=float, default=1.0, help="a limit every recipe passes: the figures are the point")
    p.add_argument("--json")
    args = p.parse_args()

    import infopt
    from infopt.bench.harness import machine_info
    from infopt.models import load_default

    model, tok = load_default()
    rows = {}
    for recipe in args.recipes.split(","):
        t = time.perf_counter()
        infopt.optimize(model, recipe, tokenizer=tok)
        plain_apply = time.perf_counter() - t
        infopt.undo(model)
        t = time.perf_counter()
        infopt.optimize(model, recipe, gate={"max_kl": args.max_kl}, tokenizer=tok)
        gated_apply = time.perf_counter() - t
        gate = model.infopt.gate
        infopt.undo(model)
        rows[recipe] = {"gate": gate, "apply_s": plain_apply, "apply_with_gate_s": gated_apply}
        path = gate["decode_path"]
        print(f"{recipe}: prompt path KL {gate['kl']:.5f} top-1 {gate['top1']:.4f}; decode path KL {path['kl']:.5f} "
              f"(max {path['kl_max']:.4f}) top-1 {path['top1']:.4f} over {path['tokens']} tokens; apply "
              f"{plain_apply:.1f} s, with the gate {gated_apply:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": machine_info(), "recipes": rows,
            "command": f"python benchmarks/studies/gate_paths.py --recipes {args.recipes} --json {args.json}",
        }, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
