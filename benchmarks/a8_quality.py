"""Quality of int8 dynamic activations (``activations: int8``) on the default model, against fp32 and against the
same weights with float activations: perplexity, KL and top-1 over 2,048 tokens of the default text.

    python benchmarks/a8_quality.py --json benchmarks/results/a8_quality.json
    python benchmarks/a8_quality.py --only g32 --json benchmarks/results/a8_quality_groups.json

The ``int8 g32`` rows are int8 weights with a scale per 32 inputs (as a GGUF file's Q8_0 blocks load): the same
codes with float activations and with int8 ones, whose kernel applies the group scales.
"""

import argparse
import copy
import json

import torch

import infopt
from infopt.bench.harness import machine_info
from infopt.eval import evaluate, make_reference
from infopt.models import load_default
from infopt.quantize import Int4WeightOnly, Int8WeightOnly
from infopt.quantize.formats import a8

p = argparse.ArgumentParser()
p.add_argument("--max-tokens", type=int, default=2048)
p.add_argument("--json", default=None)
p.add_argument("--only", default=None, help="run the methods whose label contains this text")
args = p.parse_args()

base, tok = load_default()
ref = make_reference(base, tokenizer=tok, max_tokens=args.max_tokens, dtype="float32")
methods = {
    "int4 g32 + int8 head (cpu-fast's weights)": Int4WeightOnly(group_size=32, include_lm_head=True),
    "same, int8 activations": Int4WeightOnly(group_size=32, include_lm_head=True, activations="int8"),
    "same, + shared embedding (cpu-fast's quantize step)": Int4WeightOnly(
        group_size=32, include_lm_head=True, activations="int8", share_embedding=True),
    "int8": Int8WeightOnly(),
    "int8, int8 activations": Int8WeightOnly(activations="int8"),
    "int8 + head, int8 activations": Int8WeightOnly(include_lm_head=True, activations="int8"),
    "int8 g32 + head": Int8WeightOnly(group_size=32, include_lm_head=True, compute_dtype="float32"),
    "int8 g32 + head, int8 activations": Int8WeightOnly(group_size=32, include_lm_head=True, activations="int8"),
}
if args.only:
    methods = {k: v for k, v in methods.items() if args.only in k}
rows = []
print(f"{ref.tokens} tokens; kernel ISA {a8.isa()}")
print(f"{'method':<52} {'ppl':>8} {'KL':>9} {'top-1':>7}")
for label, cfg in methods.items():
    model = copy.deepcopy(base)
    infopt.optimize(model, [cfg])
    r = evaluate(model, ref)
    rows.append({"method": label, "config": cfg.to_dict(), "ppl": r.ppl, "ppl_ref": r.ppl_ref, "kl": r.kl,
                 "top1": r.top1})
    print(f"{label:<52} {r.ppl:>8.3f} {r.kl:>9.5f} {r.top1:>7.4f}", flush=True)
    del model
if args.json:
    with open(args.json, "w") as f:
        json.dump({"machine": machine_info(), "tokens": ref.tokens, "isa": a8.isa(), "threads": torch.get_num_threads(),
                   "rows": rows}, f, indent=1)
