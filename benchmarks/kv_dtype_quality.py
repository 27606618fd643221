"""What a 16-bit static KV cache costs in quality: ``kvcache: {kind: static, dtype: float16 | bfloat16}`` against the
model's own fp32 cache, on the default model, teacher-forced over a long text.

Each variant runs the same tokens through a static cache of the text's length, ``--chunk`` tokens per forward, so
every position past the first chunk reads earlier keys and values from the cache as a decode step does (rounded
to 16 bits where the cache stores them so). Reported per variant: the mean and the largest per-position KL of its
next-token distribution from the fp32 cache's, top-1 agreement, perplexity, and the cache's bytes per token.

Usage: python benchmarks/kv_dtype_quality.py [--tokens 4096] [--chunk 256] [--json out.json]
       python benchmarks/kv_dtype_quality.py --tiny   # a random tiny model: a smoke test in seconds
The text is Python's own documentation (infopt.eval.default_text), so nothing is downloaded.
"""

import argparse
import json
import platform

import torch
import torch.nn.functional as F

from infopt.core.compat import CACHE_KWARG
from infopt.kvcache.static import full_length_static_cache

p = argparse.ArgumentParser()
p.add_argument("--tiny", action="store_true", help="tiny random model and random tokens (smoke test)")
p.add_argument("--tokens", type=int, default=4096, help="length of the teacher-forced text")
p.add_argument("--chunk", type=int, default=256, help="tokens per forward")
p.add_argument("--json", default=None, help="also write the figures to this JSON file")
args = p.parse_args()

if args.tiny:
    from infopt.models import tiny_model

    model = tiny_model("llama", hidden_size=128, num_heads=4, num_kv_heads=2, vocab_size=2048, max_positions=8192)
    args.tokens = min(args.tokens, 512)
    ids = torch.randint(3, 2000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    name = "tiny random llama (smoke test)"
else:
    from infopt.eval import encode_text
    from infopt.models import load_default

    model, tok = load_default()
    ids = encode_text(None, tok, max_tokens=args.tokens)
    if ids.shape[1] < args.tokens:
        raise SystemExit(f"the default text has {ids.shape[1]} tokens; {args.tokens} asked")
    name = "SmolLM2-135M-Instruct"
model.eval()
length = -(-ids.shape[1] // 256) * 256


@torch.inference_mode()
def logprobs(dtype) -> tuple[torch.Tensor, int]:
    cache = full_length_static_cache(model.config, length, dtype=dtype)
    out = []
    for i in range(0, ids.shape[1], args.chunk):
        piece = ids[:, i:i + args.chunk]
        logits = model(piece, **{CACHE_KWARG: cache}, position_ids=torch.arange(i, i + piece.shape[1])[None],
                       cache_position=torch.arange(i, i + piece.shape[1])).logits[0]
        out.append(F.log_softmax(logits.float(), dim=-1))
    per_token = sum(t.element_size() * t[0, :, 0].numel() for layer in cache.layers for t in (layer.keys, layer.values))
    return torch.cat(out)[:-1], per_token


targets = ids[0, 1:]
ref, ref_bytes = logprobs(None)
results = {"model": name, "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
           "model_dtype": str(next(model.parameters()).dtype), "tokens": ids.shape[1], "chunk": args.chunk, "rows": []}
print(f"{name}; torch {torch.__version__}; {ids.shape[1]} tokens, {args.chunk} per forward")
for dtype in (None, torch.bfloat16, torch.float16):
    lp, per_token = (ref, ref_bytes) if dtype is None else logprobs(dtype)
    kl = (ref.exp() * (ref - lp)).sum(-1)
    row = {"cache_dtype": "model (fp32)" if dtype is None else str(dtype).removeprefix("torch."),
           "bytes_per_token": per_token, "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
           "top1_agreement": float((lp.argmax(-1) == ref.argmax(-1)).float().mean()),
           "ppl": float(torch.exp(-lp.gather(-1, targets[:, None]).mean()))}
    results["rows"].append(row)
    print(f"  {row['cache_dtype']:>12}: {per_token / 1024:.1f} KiB/token, KL mean {row['kl_mean']:.2e} max "
          f"{row['kl_max']:.2e}, top-1 {row['top1_agreement']:.4f}, perplexity {row['ppl']:.4f}")
if args.json:
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.json}")
