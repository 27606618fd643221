"""cpu-fast at a batch of B rows (one left-padded): one AOTInductor package for every batch of 2-32 and every cache
length (warm-up at batches 1 and 2) against packages fixed to both (the old way: warm-up at batches 1 and B), in one
process: apply time, the first call's seconds (compiles in the call), greedy tokens equal, and decode tokens/s over
all rows (129 new tokens minus 1, seven alternating rounds, medians).

Usage: INFOPT_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/studies/batch_shapes.py [B] [--json out.json]
(empty caches: a package cached by an earlier run would spare either model its compiles)
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from infopt.bench import machine_info
from infopt.compile import compile_stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for cache_buckets
from cache_buckets import build  # noqa: E402  (the model with its compiled forward free or fixed)

STEPS = [{"quantize": {"method": "int4", "group_size": 32, "include_lm_head": True, "share_embedding": True,
                       "activations": "auto"}}, {"kvcache": {"kind": "static"}}]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("batch", type=int, nargs="?", default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    B, out_json = args.batch, args.json

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 10000, (B, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
    models, outs, doc = {}, {}, {"batch": B, "recipe": "cpu-fast (int4 g32, a8 where available, static, AOT)"}
    for name in ("symbolic", "fixed"):
        fixed = name == "fixed"
        compile_step = {"compile": {"mode": "default", "aot": "auto", "warmup_batch_sizes": [1, B] if fixed else [1, 2]}}
        m, s = build({"steps": STEPS + [compile_step]}, fixed)
        t0 = time.perf_counter()
        outs[name] = m.generate(ids, max_new_tokens=8, **kw)
        first = time.perf_counter() - t0
        print(name, "apply", round(s, 1), "s; first call", round(first, 1), "s", compile_stats(m).shapes, flush=True)
        doc[name] = {"apply_s": round(s, 1), "first_call_s": round(first, 1), "shapes": compile_stats(m).shapes}
        models[name] = m
    doc["same_tokens"] = bool(torch.equal(outs["fixed"], outs["symbolic"]))
    print("same tokens:", doc["same_tokens"], flush=True)
    times = {n: [] for n in models}
    for r in range(7):
        for name in (("fixed", "symbolic") if r % 2 == 0 else ("symbolic", "fixed")):
            m = models[name]
            t0 = time.perf_counter()
            m.generate(ids, max_new_tokens=129, min_new_tokens=129, **kw)
            tn = time.perf_counter() - t0
            t0 = time.perf_counter()
            m.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
            times[name].append(B * 128 / (tn - (time.perf_counter() - t0)))
    for n, v in times.items():
        print(n, "decode tok/s (all rows)", [round(x, 1) for x in v], "median", round(statistics.median(v), 1))
        doc[n].update(decode_tok_s=[round(x, 1) for x in v], median=round(statistics.median(v), 1),
                      compiles_after_warmup=compile_stats(models[n]).compiles_after_warmup)
    doc["symbolic_over_fixed"] = round(statistics.median(times["symbolic"]) / statistics.median(times["fixed"]), 3)
    print("symbolic/fixed", doc["symbolic_over_fixed"])
    doc["machine"] = machine_info("cpu")
    if out_json:
        with open(out_json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
