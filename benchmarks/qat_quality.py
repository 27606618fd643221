"""Quantization-aware training against GPTQ on the default model: perplexity, KL and top-1 against fp32.

Rows: fp32; int4 round-to-nearest (integer zero points: the format GPTQ writes, and QAT's starting point);
GPTQ int4; QAT int4 (``quantize.QAT``: a fine-tune through fake-quantized linears distilled from the fp32
model, then the same Int4Linear layers), once per ``--scales`` choice (learned scales, min/max grids). All at one group size (64 by default: the default model's 576
channels take 32 or 64). Evaluated on the first ``--max-tokens`` tokens of :func:`infopt.eval.default_text`;
GPTQ and QAT train on :func:`infopt.quantize.calibration.data.calibration_text`, the disjoint rest of the same
documentation. The int4 CPU kernel takes bf16 activations, so every int4 row includes that rounding.

The fine-tune's cost on a 2-core CPU: about 4.5-5 s per step of 4 x 256 tokens plus ~2 s per 4 rows for
the teacher pass, so the defaults (150 steps, 128 rows) take ~13 minutes; ``within_budget`` in the JSON
says whether teacher + training stayed under ``--budget-minutes``.

Usage: python benchmarks/qat_quality.py [--group-size 64] [--steps 150] [--lr 2e-5] [--scales learned minmax]
       [--scale-lr 5e-3] [--methods fp32 rtn gptq qat] [--tiny] [--out PATH]
``--tiny`` runs the same rows on a tiny random llama in seconds (a smoke test; the numbers mean nothing) and
writes its JSON to the temporary folder unless ``--out`` is given.
"""

import argparse
import copy
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
import transformers

import infopt
from infopt.core.introspect import param_bytes
from infopt.eval import evaluate, make_reference
from infopt.quantize import GPTQ, QAT, Int4WeightOnly

HERE = Path(__file__).resolve().parent

p = argparse.ArgumentParser()
p.add_argument("--group-size", type=int, default=64)
p.add_argument("--steps", type=int, default=150, help="QAT optimizer steps (~4.5-5 s each on 2 cores)")
p.add_argument("--lr", type=float, default=2e-5, help="QAT peak learning rate")
p.add_argument("--batch-size", type=int, default=4, help="QAT rows per step")
p.add_argument("--samples", type=int, default=128, help="QAT calibration rows")
p.add_argument("--seq-len", type=int, default=256, help="QAT tokens per row")
p.add_argument("--loss", default="distill", choices=["distill", "next_token"])
p.add_argument("--scales", nargs="+", default=["learned", "minmax"], choices=["learned", "minmax"],
               help="one QAT row per choice (QAT's scales field)")
p.add_argument("--scale-lr", type=float, default=5e-3, help="the learned scales' learning rate")
p.add_argument("--methods", nargs="+", default=["fp32", "rtn", "gptq", "qat"], choices=["fp32", "rtn", "gptq", "qat"],
               help="which rows to run (fp32 is the reference either way)")
p.add_argument("--gptq-samples", type=int, default=32, help="GPTQ calibration rows (as benchmarks/quantize_quality.py)")
p.add_argument("--gptq-seq-len", type=int, default=512)
p.add_argument("--max-tokens", type=int, default=4096, help="evaluated tokens of the default text")
p.add_argument("--budget-minutes", type=float, default=15.0, help="the fine-tune's time budget, checked and recorded")
p.add_argument("--tiny", action="store_true", help="a tiny random llama, a few steps: a smoke test")
p.add_argument("--out", type=Path, default=None)
args = p.parse_args()

if args.tiny:
    from infopt.models import tiny_model

    base, tok = tiny_model("llama", with_tokenizer=True)
    args.steps, args.samples, args.seq_len = min(args.steps, 5), min(args.samples, 4), min(args.seq_len, 64)
    args.gptq_samples, args.gptq_seq_len, args.max_tokens = 4, 64, min(args.max_tokens, 256)
    args.group_size = 32
    name = "tiny-llama (random)"
    out_path = args.out or Path(tempfile.gettempdir()) / "qat_quality-tiny.json"
else:
    from infopt.models import load_default

    base, tok = load_default()
    name = "SmolLM2-135M-Instruct"
    out_path = args.out or HERE / "results" / "qat_quality.json"

gs = args.group_size
qats = {f"qat-g{gs}-{sc}": QAT(group_size=gs, zero_point="int", steps=args.steps, lr=args.lr, batch_size=args.batch_size,
                               samples=args.samples, seq_len=args.seq_len, loss=args.loss, scales=sc,
                               scale_lr=args.scale_lr) for sc in args.scales}
methods = {
    "fp32": None,
    f"int4-rtn-g{gs}": Int4WeightOnly(group_size=gs, zero_point="int"),
    f"gptq-g{gs}": GPTQ(group_size=gs, samples=args.gptq_samples, seq_len=args.gptq_seq_len),
    **qats,
}
wanted = {"fp32": "fp32", "int4": "rtn", "gptq": "gptq", "qat-": "qat"}
methods = {k: v for k, v in methods.items() if next(w for p, w in wanted.items() if k.startswith(p)) in args.methods}
print(f"{name}: QAT {args.steps} steps x {args.batch_size} x {args.seq_len} tokens, lr {args.lr}, {args.loss} loss; "
      f"expect ~{(args.steps * 4.75 + args.samples / args.batch_size * 2) / 60:.0f} min of fine-tune on 2 cores",
      flush=True)
ref = make_reference(base, tokenizer=tok, max_tokens=args.max_tokens, dtype="float32")

rows = []
for label, cfg in methods.items():
    model = copy.deepcopy(base)
    t0 = time.perf_counter()
    if cfg is not None:
        # calibration=None: each step's rows of calibration_text(), disjoint from the evaluated text
        infopt.optimize(model, [cfg], tokenizer=tok)
    seconds = time.perf_counter() - t0
    r = evaluate(model, ref)
    row = {"method": label, "config": None if cfg is None else cfg.to_dict(), "ppl": r.ppl,
           "ppl_delta": r.ppl - r.ppl_ref, "kl": r.kl, "top1": r.top1, "quantize_seconds": seconds,
           "weight_mib": param_bytes(model) / 2**20}
    if isinstance(cfg, QAT):
        stats = model.infopt.steps[0].stats
        finetune = stats["teacher_seconds"] + stats["train_seconds"]
        row.update({k: stats[k] for k in ("loss", "loss_first", "loss_last", "train_steps", "train_tokens",
                                          "train_seconds", "teacher_seconds", "loss_log")})
        row["within_budget"] = finetune <= args.budget_minutes * 60
        if not row["within_budget"]:
            print(f"warning: the fine-tune took {finetune / 60:.1f} min, over the {args.budget_minutes:g} min budget; "
                  "lower --steps", flush=True)
    rows.append(row)
    print(f"  {label}: ppl {r.ppl:.3f}, KL {r.kl:.4f}, {seconds:.0f} s", flush=True)
    del model

print(f"{name}: {ref.tokens} tokens of the default text; threads {torch.get_num_threads()}")
print(f"{'method':<18} {'ppl':>9} {'Δppl':>8} {'KL':>9} {'top-1':>7} {'MiB':>7} {'seconds':>8}")
for r in rows:
    print(f"{r['method']:<18} {r['ppl']:>9.3f} {r['ppl_delta']:>+8.3f} {r['kl']:>9.5f} {r['top1']:>7.4f} "
          f"{r['weight_mib']:>7.1f} {r['quantize_seconds']:>8.1f}")
for q in rows:
    if q["method"].startswith("qat-"):
        print(f"{q['method']}: {q['train_steps']} steps, {q['loss']} loss {q['loss_first']:.4f} -> "
              f"{q['loss_last']:.4f}, teacher {q['teacher_seconds']:.0f} s + training {q['train_seconds']:.0f} s")

out_path.parent.mkdir(parents=True, exist_ok=True)
out_path.write_text(json.dumps({
    "model": name, "eval_tokens": ref.tokens, "group_size": gs, "qat": vars(args) | {"out": str(out_path)},
    "machine": platform.platform(), "processor": platform.processor(), "threads": torch.get_num_threads(),
    "torch": torch.__version__, "transformers": transformers.__version__, "infopt": infopt.__version__,
    "rows": rows,
}, indent=2))
print(f"wrote {out_path}")
