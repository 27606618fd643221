"""How much storing a reference in fp16/bf16 moves KL and top-1, against exact fp32 (int8 copy vs original).

Usage: python benchmarks/studies/eval_reference_dtype.py [--max-tokens 1024]
"""

import argparse
import copy

import infopt
from infopt.eval import evaluate, make_reference
from infopt.models import load_default

p = argparse.ArgumentParser()
p.add_argument("--max-tokens", type=int, default=1024)
args = p.parse_args()

base, tok = load_default()
refs = {d: make_reference(base, tokenizer=tok, max_tokens=args.max_tokens, dtype=d)
        for d in ("float32", "float16", "bfloat16")}
opt = infopt.optimize(copy.deepcopy(base), [infopt.quantize.Int8WeightOnly()])
exact = evaluate(opt, base, tokenizer=tok, max_tokens=args.max_tokens, window=refs["float32"].window)
print(f"{args.max_tokens} tokens of the default text; int8 weight-only copy vs the original")
print(f"{'reference':<26} {'KL':>10} {'KL error':>10} {'top-1':>7} {'self KL':>8}")
print(f"{'model, fp32 (exact)':<26} {exact.kl:>10.7f} {'':>10} {exact.top1:>7.4f} {'':>8}")
for d, ref in refs.items():
    r, self_r = evaluate(opt, ref), evaluate(base, ref)
    print(f"{'stored ' + d + ' log-probs':<26} {r.kl:>10.7f} {r.kl - exact.kl:>+10.1e} {r.top1:>7.4f} {self_r.kl:>8.2g}")
