"""Where ``gpu-fast``'s bf16 greedy output leaves plain bf16 ``generate`` on one CUDA GPU, component by component.

The GPU lane's first run found ``gpu-fast`` (SDPA + static KV cache + compiled step with CUDA graphs) token-identical
on some prompts of the default model and not on others (a difference near token 60 of 64), while the same recipe
without CUDA graphs on CPU is identical. Each row below adds one component, so the first row that differs names the
cause:

- ``static``: the static cache alone (its masked attention over the full cache length, eager kernels);
- ``static+compile``: Inductor's fused kernels, no CUDA graphs (``mode="default"``);
- ``gpu-fast``: the preset (``reduce-overhead``: CUDA graphs);
- ``gpu-fast+emulate``: the preset with Inductor's ``emulate_precision_casts`` (fused kernels round their
  intermediates to bf16 where eager kernels would);
- ``hf-static``: no infopt at all: plain ``generate(cache_implementation="static")``, transformers' own static cache
  (does the static cache's masked attention part from the dynamic cache's by itself?);
- ``plain-prefill``: no decode at all: the plain model's one forward over prompt and continuation, compared along
  the decode path only (the bf16 rounding noise transformers' own two paths show, as a scale for the rows above);
- ``fp32:gpu-fast``: the preset in fp32 (TF32 off) against plain fp32 ``generate``: the lossless claim where
  rounding differences are 2^16 times smaller than bf16's.

Each row also compares the logits of the variant's own decode path (prefill, then compiled steps), teacher-forced
along plain ``generate``'s tokens, with plain decoding's (:func:`infopt.eval.decode_path_logits`): top-1 agreement,
mean KL, the largest logit difference. Each differing prompt also records the plain model's margin at the token where the outputs part: its top-1 logit
minus its top-2 (a near-tie is a margin of a bf16 rounding step or two; a real error would part at wide margins).

The second run (H200) found the ``static`` row already parting on two prompts of five (near token 55), and
``static+compile`` / ``gpu-fast`` on three (from token 11), while teacher-forced logits over the evaluation text
agreed (KL < 1e-5, top-1 1.0).

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
from infopt.eval import decode_path_logits, first_difference, logit_metrics
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
    "hf-static": None,  # transformers alone
    "plain-prefill": "prefill",  # no generate: the plain model's whole-sequence forward, decode path metrics only
    "fp32:gpu-fast": "gpu-fast",
}


def margin(model, ids: torch.Tensor, want: torch.Tensor, at: int) -> float:
    """The plain model's top-1 minus top-2 logit at generated position ``at`` (after ``want``'s first ``at`` tokens)."""
    prefix = want[:, : ids.shape[1] + at]
    with torch.no_grad():
        top = model(prefix).logits[0, -1].float().topk(2).values
    return round(float(top[0] - top[1]), 4)


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
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 rows compare fp32 arithmetic
    torch.backends.cudnn.allow_tf32 = False
    kw = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)
    refs: dict = {}  # dtype -> (plain model, [(prompt, ids, plain output)])

    def reference(dtype):
        if dtype not in refs:
            ref, tok = load_default(dtype=dtype, device=dev)
            prompts = []
            for q in PROMPTS:
                text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=False)
                ids = tok(text, return_tensors="pt").input_ids.to(dev)
                prompts.append((q, ids, ref.generate(ids, **kw)))
            paths = [decode_path_logits(ref, ids, want[0, ids.shape[1]:]) for _, ids, want in prompts]
            refs[dtype] = (ref, prompts, paths)
        return refs[dtype]

    rows = []
    for name in args.variants.split(","):
        row: dict = {"variant": name}
        try:
            import torch._inductor.config as inductor_config

            dtype = torch.float32 if name.startswith("fp32:") else torch.bfloat16
            row["dtype"] = str(dtype).removeprefix("torch.")
            ref, prompts, paths = reference(dtype)
            patch = (inductor_config.patch(emulate_precision_casts=True) if name.endswith("+emulate")
                     else contextlib.nullcontext())
            with patch:
                m, _ = load_default(dtype=dtype, device=dev)
                extra = {}
                if VARIANTS[name] is None:
                    extra = {"cache_implementation": "static"}
                elif VARIANTS[name] != "prefill":
                    infopt.optimize(m, VARIANTS[name])
                row["first_difference"], row["plain_margin_there"] = {}, {}
                for q, ids, want in (prompts if VARIANTS[name] != "prefill" else ()):  # positions in generated tokens
                    at = first_difference(want[0, ids.shape[1]:].tolist(),
                                          m.generate(ids, **kw, **extra)[0, ids.shape[1]:].tolist())
                    row["first_difference"][q] = at
                    if at is not None:
                        row["plain_margin_there"][q] = margin(ref, ids, want, at)
                if VARIANTS[name] is not None:  # teacher-forced along plain generate's tokens
                    if VARIANTS[name] == "prefill":
                        with torch.no_grad():
                            got = torch.cat([m(want[:, :-1]).logits[0, ids.shape[1] - 1:].float()
                                             for _, ids, want in prompts])
                    else:
                        got = torch.cat([decode_path_logits(m, ids, want[0, ids.shape[1]:]) for _, ids, want in prompts])
                    plain = torch.cat(paths)
                    figures = logit_metrics(got, plain)
                    agree = got.argmax(-1) == plain.argmax(-1)
                    top2 = plain.topk(2, dim=-1).values
                    row["decode_path"] = {
                        "positions": int(agree.numel()), "top1": round(figures["top1"], 5),
                        "kl_mean": figures["kl"], "kl_max": figures["kl_max"],
                        "max_abs_logit_diff": round(float((got - plain).abs().max()), 5),
                        "plain_margins_where_top1_differs": [round(float(x), 4) for x in
                                                             (top2[:, 0] - top2[:, 1])[~agree].tolist()]}
            if row["first_difference"]:
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
