"""Where the int8 top-1 gap comes from on the default model, and the weight bytes each format stores.

Rows (KL / top-1 / perplexity against the fp32 model on 1,024 tokens of the eval text):
- the whole model cast to bf16 (no quantization): the cost of bf16 rounding alone;
- int8 per channel with bf16 activations (the fused kernel) and with fp32 activations;
- int8 with 32-channel groups and fp32 activations;
- with the output head quantized too (what makes int8 decode fast: the fp32 head is the largest single read per
  token): per channel, and with 32- and 64-channel groups;
- with ``--gptq``: 8-bit GPTQ per channel (error-compensated rounding on the calibration text), head in fp32.
The embedded model is a dequantized GGUF (Q4_1 projections, Q8_0 embedding): any format with 32-channel groups
lines up with its blocks, which flatters g32 against per-channel scales here.
Also: distinct weight values per group of 32 in one MLP layer (the embedded model is a dequantized Q4_1
GGUF: at most 16), and the bytes of the attention + MLP projections in fp32, int8 and int4 (g32, g64).

Usage: python benchmarks/studies/int8_precision.py [--max-tokens 1024] [--gptq] [--json out.json]
"""

import argparse
import json

import torch

import infopt
from infopt.core.introspect import param_bytes
from infopt.eval import evaluate, make_reference
from infopt.models import load_default
from infopt.quantize import GPTQ, Int4WeightOnly, Int8WeightOnly
from infopt.quantize.api import quantize_targets

p = argparse.ArgumentParser()
p.add_argument("--json", default=None)
p.add_argument("--max-tokens", type=int, default=1024)
p.add_argument("--gptq", action="store_true", help="add 8-bit GPTQ (about 2 minutes)")
args = p.parse_args()

model, tok = load_default()
ref = make_reference(model, tokenizer=tok, max_tokens=args.max_tokens, dtype="float32")
out = {"tokens": ref.tokens}


def row(name, m):
    r = evaluate(m, ref)
    out[name] = {"kl": r.kl, "top1": r.top1, "ppl": r.ppl}
    print(f"{name:<34} KL {r.kl:.5f}  top-1 {r.top1:.4f}  ppl {r.ppl:.3f}", flush=True)


bf16 = load_default()[0].to(torch.bfloat16)
row("fp32 model cast to bf16", bf16)
del bf16
rows = [("int8 per channel, bf16 activations", Int8WeightOnly(compute_dtype="bfloat16")),
        ("int8 per channel, fp32 activations", Int8WeightOnly(compute_dtype="float32")),
        ("int8 g32, fp32 activations", Int8WeightOnly(group_size=32, compute_dtype="float32")),
        ("int8 per channel + head, fp32 activations", Int8WeightOnly(compute_dtype="float32", include_lm_head=True)),
        ("int8 g64 + head, fp32 activations",
         Int8WeightOnly(group_size=64, compute_dtype="float32", include_lm_head=True)),
        ("int8 g32 + head, fp32 activations",
         Int8WeightOnly(group_size=32, compute_dtype="float32", include_lm_head=True))]
if args.gptq:
    rows.append(("gptq 8-bit per channel", GPTQ(bits=8, group_size=-1, samples=32, seq_len=512)))
for name, cfg in rows:
    infopt.optimize(model, [cfg])
    row(name, model)
    infopt.undo(model)

w = model.model.layers[3].mlp.up_proj.weight.detach().reshape(-1, 32)
distinct = torch.tensor([len(torch.unique(r)) for r in w[:2000]]).float()
out["distinct_per_group32_median"] = float(distinct.median())
out["distinct_per_group32_max"] = float(distinct.max())
print(f"distinct values per group of 32 (layer 3 up_proj, 2,000 groups): median {distinct.median():.0f}, "
      f"max {distinct.max():.0f}")

names = [t.fqn for t in quantize_targets(model, Int8WeightOnly())]
fp32 = sum(model.get_submodule(n).weight.numel() * 4 for n in names)
sizes = {"fp32": fp32}
for name, cfg in [("int8", Int8WeightOnly()), ("int4 g32", Int4WeightOnly(group_size=32)),
                  ("int4 g64", Int4WeightOnly(group_size=64))]:
    infopt.optimize(model, [cfg])
    sizes[name] = sum(param_bytes(model.get_submodule(n)) for n in names)
    infopt.undo(model)
out["projection_bytes"] = sizes
for k, v in sizes.items():
    print(f"attention + MLP projections, {k:<9} {v / 1e6:7.1f} MB  {v / fp32:.3f}x fp32")
if args.json:
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
