"""How much of FP8 weight-only's quality loss on the default model is its scales' granularity, and how much e4m3
itself: every decoder linear's weight rounded to float8_e4m3fn with one scale per output row (infopt's FP8 layout)
or per group of 64 / 32 inputs, against int8 with one scale per row, the head kept, KL / top-1 against the fp32
model on the evaluation text (simulated in fp32 on CPU: the same rounding the GPU kernels read).

    python benchmarks/studies/fp8_weight_granularity.py [--tokens 512]
"""
from __future__ import annotations

import argparse
import copy
import json

import torch

from infopt.eval.metrics import encode_text, logit_metrics
from infopt.models import load_default


def fake_quant(w: torch.Tensor, group: int | None, kind: str) -> torch.Tensor:
    out, inp = w.shape
    g = inp if group is None else group
    blocks = w.reshape(out, inp // g, g)
    top = 448.0 if kind == "fp8" else 127.0
    scale = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-12) / top
    q = blocks / scale
    q = q.to(torch.float8_e4m3fn).float() if kind == "fp8" else q.round().clamp(-127, 127)
    return (q * scale).reshape(out, inp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    model, tokenizer = load_default()
    ids = encode_text(None, tokenizer, max_tokens=args.tokens)
    with torch.no_grad():
        ref = model(ids).logits.float()
    rows = {}
    for name, kind, group in [("fp8 per row", "fp8", None), ("fp8 g64", "fp8", 64), ("fp8 g32", "fp8", 32),
                              ("int8 per row", "int8", None)]:
        copy_ = copy.deepcopy(model)
        with torch.no_grad():
            for fqn, mod in copy_.named_modules():
                if isinstance(mod, torch.nn.Linear) and not fqn.endswith("lm_head"):
                    mod.weight.copy_(fake_quant(mod.weight.float(), group, kind))
            figures = logit_metrics(copy_(ids).logits.float(), ref)
        rows[name] = {k: round(float(v), 5) for k, v in figures.items()}
        print(f"{name:14s} " + "  ".join(f"{k} {v}" for k, v in rows[name].items()), flush=True)
    print(json.dumps({"tokens": int(ids.shape[-1]), "rows": rows}))


if __name__ == "__main__":
    main()
