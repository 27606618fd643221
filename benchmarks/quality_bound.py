"""A quantize step's error bound (``max_kl``) on the default model: what each config measures, what the fit keeps, what
that costs at apply time, and whether the bound holds on held-out text.

Usage: python benchmarks/quality_bound.py [--json benchmarks/results/quality_bound.json]

For each config, twice: without a bound and with one. Each run loads the default model fresh, measures the reference
logits over 512 tokens of the evaluation text (``infopt.eval``'s, disjoint from the 256 tokens of calibration text the
bound is fitted on), applies the quantize step alone through ``infopt.optimize``, and reports the step's seconds, the
fit (``stats["bound"]``) and the held-out KL / top-1 against the reference.
"""

import argparse
import json
import time
from pathlib import Path

import torch

import infopt
from infopt import eval as ev
from infopt.models import load_default

CONFIGS = {
    # cpu-fast's quantize step
    "cpu-fast": {"method": "int4", "group_size": 32, "include_lm_head": True, "share_embedding": True,
                 "activations": "auto"},
    # a 4-bit head (the most sensitive layer)
    "int4-g32-head4": {"method": "int4", "group_size": 32, "include_lm_head": True, "lm_head_bits": 4,
                       "activations": "auto"},
    # coarser still: a 4-bit head and groups of 64
    "int4-g64-head4": {"method": "int4", "group_size": 64, "include_lm_head": True, "lm_head_bits": 4,
                       "activations": "auto"},
}

p = argparse.ArgumentParser()
p.add_argument("--json", default=None)
p.add_argument("--bounds", type=float, nargs="+", default=[0.02, 0.005])
args = p.parse_args()
torch.set_num_threads(2)

rows = []
for name, base in CONFIGS.items():
    for bound in (None, *args.bounds):
        model, tok = load_default()
        ref = ev.reference_logits(model, tokenizer=tok)
        q = dict(base, **({} if bound is None else {"max_kl": bound}))
        t0 = time.perf_counter()
        infopt.optimize(model, {"steps": [{"quantize": q}]}, tokenizer=tok)
        seconds = time.perf_counter() - t0
        held_out = ev.compare(model, ref)
        step = model.infopt.steps[0]
        fit = step.stats.get("bound")
        row = {"config": name, "max_kl": bound, "apply_s": round(seconds, 2),
               "held_out": {"kl": held_out["kl"], "top1": held_out["top1"], "tokens": held_out.get("tokens")},
               "weights_mib": round(model.infopt.memory_after / 2**20, 1)}
        if fit is not None:
            row["fit"] = {k: fit[k] for k in ("kl_quantized", "kl", "top1", "tokens", "tries", "seconds")}
            row["fit"]["kept"] = fit["kept"]
        rows.append(row)
        kept = "" if fit is None else f" kept {len(fit['kept'])}: calibration KL {fit['kl_quantized']:.4f} -> {fit['kl']:.4f}"
        print(f"{name:16s} max_kl={bound!s:6s} apply {seconds:6.1f} s  held-out KL {held_out['kl']:.4f} "
              f"top-1 {held_out['top1']:.3f}  weights {row['weights_mib']} MiB{kept}", flush=True)
        del model

if args.json:
    out = {"machine": {"threads": 2, "date": time.strftime("%Y-%m-%dT%H:%M:%S")}, "torch": torch.__version__,
           "rows": rows}
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
