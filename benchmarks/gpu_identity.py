"""Where ``gpu-fast``'s bf16 greedy output leaves plain bf16 ``generate`` on one CUDA GPU, component by component.

The GPU lane's first run found ``gpu-fast`` (SDPA + static KV cache + compiled step with CUDA graphs) token-identical
on some prompts of the default model and not on others (a difference near token 60 of 64), while the same recipe
without CUDA graphs on CPU is identical. Each row below adds one component, so the first row that differs names the
cause:

- ``static``: the static cache alone (its masked attention over the full cache length, eager kernels);
- ``static+compile``: Inductor's fused kernels, no CUDA graphs (``mode="default"``);
- ``gpu-fast``: the preset (``reduce-overhead``: CUDA graphs);
- ``gpu-fast+emulate``: the preset with Inductor's ``emulate_precision_casts`` (fused kernels round their
  intermediates to bf16 where eager kernels would).

Usage: python benchmarks/gpu_identity.py [--tokens 64] [--json out.json]
       python benchmarks/gpu_identity.py --device cpu --variants static,static+compile --tokens 16   # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import json
import traceback

import torch

import infopt
from infopt.bench.harness import machine_info
from infopt.eval import first_difference
from infopt.models import load_default

PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "Explain recursion to a child.",
           "List three uses of a paperclip.", "Why is the sky blue? Answer briefly.")
STATIC = {"kvcache": {"kind": "static"}}
SDPA = {"attention": {"backend": "sdpa"}}
VARIANTS = {
    "static": [SDPA, STATIC],
    "static+compile": [SDPA, STATIC, {"compile": {"mode": "default"}}],
    "gpu-fast": "gpu-fast",
    "gpu-fast+emulate": "gpu-fast",
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--device", default="cuda", help="cpu runs the variants without CUDA graphs (a smoke test)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_identity.py needs a CUDA device")
    dev = args.device
    ref, tok = load_default(dtype=torch.bfloat16, device=dev)
    kw = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
    prompts = []
    for q in PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        ids = tok(text, return_tensors="pt").input_ids.to(dev)
        prompts.append((q, ids, ref.generate(ids, **kw)))
    del ref
    rows = []
    for name in args.variants.split(","):
        row: dict = {"variant": name}
        try:
            import torch._inductor.config as inductor_config

            patch = (inductor_config.patch(emulate_precision_casts=True) if name.endswith("+emulate")
                     else contextlib.nullcontext())
            with patch:
                m, _ = load_default(dtype=torch.bfloat16, device=dev)
                infopt.optimize(m, VARIANTS[name])
                row["first_difference"] = {  # in generated tokens
                    q: first_difference(want[0, ids.shape[1]:].tolist(), m.generate(ids, **kw)[0, ids.shape[1]:].tolist())
                    for q, ids, want in prompts}
            row["identical"] = sum(v is None for v in row["first_difference"].values())
            del m
        except Exception as e:  # one variant failing must not hide the others
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc()[-3000:]
        if dev == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": machine_info(dev), "tokens": args.tokens, "prompts": list(PROMPTS),
                           "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
