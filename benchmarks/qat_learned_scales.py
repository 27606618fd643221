"""An experiment: QAT with learned per-group scales, against QAT's min/max grids (``benchmarks/qat_quality.py``).

``quantize.QAT`` recomputes every group's scale from the current weights (min/max) each step. This script patches
``QATLinear`` so each group's scale is learned instead, as a log-scale on its own learning rate (``--scale-lr``),
from its min/max start; the zero points stay fixed at their start. Everything else is the QAT row of
``benchmarks/qat_quality.py`` (g64, integer zero points, 150 steps, lr 2e-5, distill; 4,096 evaluated tokens).
The converted ``Int4Linear`` layers use the learned scales. When ``QAT`` learns scales itself, this script goes.

Usage: python benchmarks/qat_learned_scales.py [--scale-lr 2e-3] [--steps 150] [--tiny] [--out PATH]
(about 15 minutes on 2 cores; ``--tiny``: a tiny random llama in seconds, a smoke test)
"""

import argparse
import inspect
import json
import textwrap
import time

import torch
import torch.nn.functional as F
from torch import nn

import infopt
from infopt.eval import evaluate, make_reference
from infopt.quantize import QAT
from infopt.quantize import qat as qat_mod
from infopt.quantize.int4 import Int4Linear, quantize_int4_grouped

p = argparse.ArgumentParser()
p.add_argument("--scale-lr", type=float, default=2e-3, help="AdamW learning rate of the log-scales")
p.add_argument("--steps", type=int, default=150)
p.add_argument("--group-size", type=int, default=64)
p.add_argument("--max-tokens", type=int, default=4096)
p.add_argument("--tiny", action="store_true")
p.add_argument("--out", default=None)
args = p.parse_args()

_init = qat_mod.QATLinear.__init__


def _patched_init(self, weight, bias, config, dtype):
    _init(self, weight, bias, config, dtype)
    _, s, z = quantize_int4_grouped(self._rounding_input(), self.group_size, config.symmetric, config.zero_point)
    self.register_buffer("s0", s.clone())
    self.logscale = nn.Parameter(torch.zeros_like(s))
    self.register_buffer("qzero", z.clone())


def _scale(self) -> torch.Tensor:
    return (self.s0 * self.logscale.exp()).clamp(min=1e-8)


def _fake_quant(self, w: torch.Tensor) -> torch.Tensor:
    o, i = w.shape
    s, z = _scale(self).unsqueeze(-1), self.qzero.unsqueeze(-1)
    r = w.view(o, i // self.group_size, self.group_size) / s + z
    c = (r + (r.round() - r).detach()).clamp(0, 15)  # rounding: straight through; clamping: no gradient outside
    return ((c - z) * s).reshape(o, i)


def _patched_forward(self, x):
    b = None if self.bias is None else self.bias.to(x.dtype)
    return F.linear(x, _fake_quant(self, self.weight).to(x.dtype), b)


def _patched_to_quantized(self):
    with torch.no_grad():
        w = self._rounding_input()
        o, i = w.shape
        s, z = _scale(self), self.qzero
        codes = (w.view(o, i // self.group_size, self.group_size) / s.unsqueeze(-1) + z.unsqueeze(-1)).round()
        codes = codes.clamp(0, 15).reshape(o, i).to(torch.uint8)
        bias = None if self.bias is None else self.bias.detach().to(self.out_dtype)
        return Int4Linear.from_codes(codes, s.clone(), z.clone(), group_size=self.group_size, bias=bias,
                                     dtype=self.out_dtype)


qat_mod.QATLinear.__init__ = _patched_init
qat_mod.QATLinear.forward = _patched_forward
qat_mod.QATLinear.to_quantized = _patched_to_quantized
# the fine-tune's optimizer with the log-scales in a group of their own
_src = textwrap.dedent(inspect.getsource(qat_mod._finetune))
_old = "    opt = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)"
if _old not in _src:
    raise SystemExit("quantize.qat._finetune changed: update this experiment's optimizer patch")
_src = _src.replace(_old, f"""    groups = [{{"params": [p for m in layers.values() for n, p in m.named_parameters() if n != "logscale"],
                "lr": config.lr}}, {{"params": [m.logscale for m in layers.values()], "lr": {args.scale_lr!r}}}]
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95), weight_decay=0.0)""")
exec(compile(_src, qat_mod.__file__, "exec"), qat_mod.__dict__)

if args.tiny:
    from infopt.models import tiny_model

    base, tok = tiny_model("llama", with_tokenizer=True)
    cfg = QAT(group_size=32, zero_point="int", steps=min(args.steps, 3), batch_size=2, samples=4, seq_len=32)
    max_tokens = 128
else:
    from infopt.models import load_default

    base, tok = load_default()
    cfg = QAT(group_size=args.group_size, zero_point="int", steps=args.steps, lr=2e-5, batch_size=4, samples=128,
              seq_len=256)
    max_tokens = args.max_tokens
ref = make_reference(base, tokenizer=tok, max_tokens=max_tokens, dtype="float32")
t0 = time.perf_counter()
infopt.optimize(base, [cfg], tokenizer=tok)
r = evaluate(base, ref)
out = {"scales": "learned log-scales", "scale_lr": args.scale_lr, "config": cfg.to_dict(), "eval_tokens": ref.tokens,
       "ppl_delta": r.ppl - r.ppl_ref, "kl": r.kl, "top1": r.top1, "seconds": time.perf_counter() - t0}
print(json.dumps(out, indent=1))
if args.out:
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
