"""Quality of the weight quantizers on the default model: perplexity, KL and top-1 against fp32.

Evaluated on the first 512 tokens of :func:`infopt.eval.default_text`; GPTQ and AWQ calibrate on
:func:`infopt.quantize.calibration.data.calibration_text`, a disjoint slice of the same documentation.
The int4 and int8 CPU kernels take bf16 activations, so their figures include that rounding.

Usage: python benchmarks/quantize_quality.py [--samples 32] [--seq-len 512] [--group-size 64] [--tiny] [--out PATH]
``--tiny`` runs the same table on a tiny random llama in seconds (a smoke test; the numbers mean nothing).
"""

import argparse
import copy
import json
import platform
import time
from pathlib import Path

import torch
import transformers

import infopt
from infopt.eval import evaluate, make_reference
from infopt.quantize import AWQ, GPTQ, Int4WeightOnly, Int8WeightOnly, SmoothQuantW8A8
from infopt.quantize.calibration.data import calibration_ids

HERE = Path(__file__).resolve().parent

p = argparse.ArgumentParser()
p.add_argument("--samples", type=int, default=32,
               help="calibration sequences for GPTQ and AWQ (0: each config's default, 128 / 64: ~4x slower on CPU)")
p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration sequence")
p.add_argument("--group-size", type=int, default=64)
p.add_argument("--max-tokens", type=int, default=512, help="evaluated tokens of the default text")
p.add_argument("--methods", nargs="+", default=None, help="only these rows (labels as printed; default: all)")
p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
               help="the model's dtype for every row (the reference stays fp32)")
p.add_argument("--tiny", action="store_true", help="a tiny random llama and little calibration: a smoke test")
p.add_argument("--out", type=Path, default=None)
args = p.parse_args()

if args.tiny:
    from infopt.models import tiny_model

    base, tok = tiny_model("llama", with_tokenizer=True)
    args.samples, args.seq_len, args.max_tokens = min(args.samples or 4, 4), min(args.seq_len, 64), min(args.max_tokens, 128)
    name = "tiny-llama (random)"
else:
    from infopt.models import load_default

    base, tok = load_default()
    name = "SmolLM2-135M-Instruct"
out_path = args.out or HERE / "results" / ("quantize_quality-tiny.json" if args.tiny else "quantize_quality.json")
if args.methods and not args.out:
    p.error("--methods writes a partial table: give it its own --out")

gs = args.group_size
cal = {"samples": args.samples} if args.samples else {}
methods = {
    {"float32": "fp32", "bfloat16": "bf16"}[args.dtype]: None,  # the unquantized model
    # integer zero points: the format GPTQ and AWQ produce, so the comparison is like for like
    f"int4-rtn-g{gs}": Int4WeightOnly(group_size=gs, zero_point="int"),
    f"gptq-g{gs}": GPTQ(group_size=gs, seq_len=args.seq_len, **cal),
    f"awq-g{gs}": AWQ(group_size=gs, seq_len=args.seq_len, **cal),
    # float zero points (the Int4WeightOnly default); at g32 they land on the embedded model's Q4_1 grid
    f"int4-rtn-float-g{gs}": Int4WeightOnly(group_size=gs),
    "int4-rtn-float-g32": Int4WeightOnly(group_size=32),
    "int4-g32+int8-head": Int4WeightOnly(group_size=32, include_lm_head=True),
    "int8": Int8WeightOnly(),
    "int8+head": Int8WeightOnly(include_lm_head=True),
    # int8 weights x per-token int8 activations (the W8A8 kernel the engine runs faster than bf16)
    "smoothquant": SmoothQuantW8A8(seq_len=args.seq_len, **cal),
}
if args.methods:
    unknown = set(args.methods) - set(methods)
    if unknown:
        p.error(f"unknown --methods {sorted(unknown)}; choose from {list(methods)}")
    methods = {k: v for k, v in methods.items() if k in args.methods}
ref = make_reference(base, tokenizer=tok, max_tokens=args.max_tokens, dtype="float32")
n_cal = max([getattr(c, "samples", 0) for c in methods.values() if c is not None] + [1])
ids = calibration_ids(base, None, tokenizer=tok, samples=n_cal, seq_len=args.seq_len)

rows = []
for label, cfg in methods.items():
    model = copy.deepcopy(base).to(getattr(torch, args.dtype))
    t0 = time.perf_counter()
    if cfg is not None:
        infopt.optimize(model, [cfg], calibration=ids, tokenizer=tok)
    seconds = time.perf_counter() - t0
    r = evaluate(model, ref)
    rows.append({"method": label, "config": None if cfg is None else cfg.to_dict(), "ppl": r.ppl,
                 "ppl_delta": r.ppl - r.ppl_ref, "kl": r.kl, "top1": r.top1, "quantize_seconds": seconds,
                 "weight_mib": infopt.core.introspect.param_bytes(model) / 2**20})
    del model

print(f"{name}: {ref.tokens} tokens of the default text; calibration {ids.shape[0]} x {ids.shape[1]} tokens "
      f"of calibration_text()")
print(f"{'method':<14} {'ppl':>9} {'Δppl':>8} {'KL':>9} {'top-1':>7} {'MiB':>7} {'quantize s':>10}")
for r in rows:
    print(f"{r['method']:<14} {r['ppl']:>9.3f} {r['ppl_delta']:>+8.3f} {r['kl']:>9.5f} {r['top1']:>7.4f} "
          f"{r['weight_mib']:>7.1f} {r['quantize_seconds']:>10.1f}")

out_path.parent.mkdir(parents=True, exist_ok=True)
out_path.write_text(json.dumps({
    "model": name, "dtype": args.dtype, "eval_tokens": ref.tokens, "calibration": list(ids.shape), "group_size": gs,
    "machine": platform.platform(), "processor": platform.processor(), "threads": torch.get_num_threads(),
    "torch": torch.__version__, "transformers": transformers.__version__, "infopt": infopt.__version__,
    "rows": rows,
}, indent=2))
print(f"wrote {out_path}")
