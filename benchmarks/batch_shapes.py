"""cpu-fast at a batch of B rows (one left-padded): one AOTInductor package for every batch of 2-32 and every cache
length (warm-up at batches 1 and 2) against packages fixed to both (the old way: warm-up at batches 1 and B), in one
process: apply time, the first call's seconds (compiles in the call), greedy tokens equal, and decode tokens/s over
all rows (129 new tokens minus 1, seven alternating rounds, medians).

Usage: INFOPT_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/batch_shapes.py [B] [--json out.json]
(empty caches: a package cached by an earlier run would spare either model its compiles)
"""
import json
import statistics
import sys
import time

import torch

import infopt
from infopt.compile import compile_stats
from infopt.compile import decoder as compiled_decoder
from infopt.models import load_default

args = [a for a in sys.argv[1:] if not a.startswith("--")]
B = int(args[0]) if args else 3
JSON = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
if JSON in args:
    args.remove(JSON)
    B = int(args[0]) if args else 3
steps = [{"quantize": {"method": "int4", "group_size": 32, "include_lm_head": True, "share_embedding": True,
                       "activations": "auto"}}, {"kvcache": {"kind": "static"}}]


def build(fixed):
    init = compiled_decoder.CompiledForward.__init__
    if fixed:
        def one(self, *a, **k):
            init(self, *a, **k)
            self.free_length = False
        compiled_decoder.CompiledForward.__init__ = one
    try:
        m, _ = load_default()
        t0 = time.perf_counter()
        infopt.optimize(m, {"steps": steps + [{"compile": {"mode": "default", "aot": "auto",
                                                            "warmup_batch_sizes": [1, B] if fixed else [1, 2]}}]})
        return m, time.perf_counter() - t0
    finally:
        compiled_decoder.CompiledForward.__init__ = init


g = torch.Generator().manual_seed(0)
ids = torch.randint(100, 10000, (B, 40), generator=g)
mask = torch.ones_like(ids)
mask[0, :5] = 0
models, outs, doc = {}, {}, {"batch": B, "recipe": "cpu-fast (int4 g32, a8 where available, static, AOT)"}
for name in ("symbolic", "fixed"):
    m, s = build(name == "fixed")
    t0 = time.perf_counter()
    outs[name] = m.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    first = time.perf_counter() - t0
    print(name, "apply", round(s, 1), "s; first call", round(first, 1), "s", compile_stats(m).shapes, flush=True)
    doc[name] = {"apply_s": round(s, 1), "first_call_s": round(first, 1), "shapes": compile_stats(m).shapes}
    models[name] = m
print("same tokens:", torch.equal(outs["fixed"], outs["symbolic"]), flush=True)
times = {n: [] for n in models}
for r in range(7):
    for name in (("fixed", "symbolic") if r % 2 == 0 else ("symbolic", "fixed")):
        m = models[name]
        kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
        t0 = time.perf_counter()
        m.generate(ids, max_new_tokens=129, min_new_tokens=129, **kw)
        tn = time.perf_counter() - t0
        t0 = time.perf_counter()
        m.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        times[name].append(B * 128 / (tn - (time.perf_counter() - t0)))
for n, v in times.items():
    print(n, "decode tok/s (all rows)", [round(x, 1) for x in v], "median", round(statistics.median(v), 1))
print("symbolic/fixed", round(statistics.median(times["symbolic"]) / statistics.median(times["fixed"]), 3))
print({n: compile_stats(m).compiles_after_warmup for n, m in models.items()})
from infopt.bench import machine_info  # noqa: E402

doc["same_tokens"] = bool(torch.equal(outs["fixed"], outs["symbolic"]))
for n, v in times.items():
    doc[n].update(decode_tok_s=[round(x, 1) for x in v], median=round(statistics.median(v), 1),
                  compiles_after_warmup=compile_stats(models[n]).compiles_after_warmup)
doc["symbolic_over_fixed"] = round(statistics.median(times["symbolic"]) / statistics.median(times["fixed"]), 3)
doc["machine"] = machine_info("cpu")
if JSON:
    with open(JSON, "w") as f:
        json.dump(doc, f, indent=1)
