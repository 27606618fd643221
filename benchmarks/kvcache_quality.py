"""Quality and memory of the lossy KV caches on the default model: Quantized (int8/int4), Sinks, HeavyHitter.

- Quantized: cache bytes against fp32 at --mem-tokens tokens; next-token top-1 agreement and KL against the
  plain cache over --positions teacher-forced positions that follow --context tokens (so every evaluated
  position reads a quantized past; each token goes through the cache like a decode step, --chunk at a time).
- Sinks: perplexity over 4 x --window tokens of text, teacher-forced through the cache, against the plain
  model over the same tokens (full context) and a window without sinks; cache bytes at W, 2W, 4W (flat).
  HeavyHitter with budget --window runs the same way (eager attention).

Usage: python benchmarks/kvcache_quality.py [--window 256] [--positions 512] [--json out.json]
       python benchmarks/kvcache_quality.py --tiny   # a random tiny model and random tokens: a smoke test in seconds
The text is Python's own documentation (infopt.eval.default_text), so nothing is downloaded.
"""

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F
from transformers import DynamicCache

import infopt
from infopt.kvcache import HeavyHitter, Quantized, Sinks, use_

p = argparse.ArgumentParser()
p.add_argument("--tiny", action="store_true", help="tiny random model and random tokens (smoke test)")
p.add_argument("--mem-tokens", type=int, default=4096)
p.add_argument("--context", type=int, default=512, help="tokens before the evaluated positions (quantized)")
p.add_argument("--positions", type=int, default=512, help="teacher-forced positions compared (quantized)")
p.add_argument("--window", type=int, default=256, help="Sinks window / HeavyHitter budget; text is 4x this")
p.add_argument("--sinks", type=int, default=4)
p.add_argument("--chunk", type=int, default=1, help="tokens per forward when teacher-forcing through a cache")
p.add_argument("--json", default=None, help="also write the figures to this JSON file")
args = p.parse_args()

if args.tiny:
    from infopt.models import tiny_model

    model = tiny_model("llama", hidden_size=128, num_heads=2, num_kv_heads=1, vocab_size=2048, max_positions=8192)
    args.mem_tokens, args.context, args.positions, args.window = 1024, 128, 64, 32
    quant_configs = [Quantized(bits=8, group_size=32, residual_length=64), Quantized(bits=4, group_size=32,
                                                                                      residual_length=64)]
    need = max(args.mem_tokens, args.context + args.positions, 4 * args.window)
    text_ids = torch.randint(3, 2000, (1, need), generator=torch.Generator().manual_seed(0))
    model_name = "tiny random llama (smoke test)"
else:
    from infopt.eval import encode_text
    from infopt.models import load_default

    model, tok = load_default()
    quant_configs = [Quantized(bits=8), Quantized(bits=4)]
    need = max(args.mem_tokens, args.context + args.positions, 4 * args.window)
    text_ids = encode_text(None, tok, max_tokens=need)
    if text_ids.shape[1] < need:
        raise SystemExit(f"the default text has {text_ids.shape[1]} tokens; {need} needed")
    model_name = "SmolLM2-135M-Instruct"
model.eval()
results: dict = {"model": model_name, "torch": torch.__version__, "threads": torch.get_num_threads(),
                 "machine": platform.machine(), "dtype": str(next(model.parameters()).dtype), "args": vars(args)}
print(f"{model_name}; torch {torch.__version__}, {torch.get_num_threads()} threads, {results['dtype']}")


@torch.inference_mode()
def teacher_forced(ids: torch.Tensor, cache, start: int, chunk: int, positions=None, on_step=None) -> torch.Tensor:
    """Log-probs ``[T - start, V]`` of each next token for positions ``start..T-1``, feeding ``ids[:, start:]``
    ``chunk`` tokens at a time through ``cache`` (after one prefill of ``ids[:, :start]``)."""
    if start:
        model(ids[:, :start], past_key_values=cache, **(positions(0, start) if positions else {}))
    out = []
    for i in range(start, ids.shape[1], chunk):
        piece = ids[:, i:i + chunk]
        kw = positions(i, piece.shape[1]) if positions else {}
        out.append(F.log_softmax(model(piece, past_key_values=cache, **kw).logits[0].float(), dim=-1))
        if on_step is not None:
            on_step(i + piece.shape[1])
    return torch.cat(out)


def true_positions(i: int, n: int) -> dict:
    return {"position_ids": torch.arange(i, i + n).unsqueeze(0)}


@torch.inference_mode()
def plain_logprobs(ids: torch.Tensor, start: int, chunk: int = 256) -> torch.Tensor:
    """Full-context log-probs for positions ``start..T-1`` (a plain dynamic cache, 256 tokens per forward)."""
    cache, out = DynamicCache(config=model.config), []
    for i in range(0, ids.shape[1], chunk):
        logits = model(ids[:, i:i + chunk], past_key_values=cache).logits[0]
        lo = max(start - i, 0)
        if lo < logits.shape[0]:
            out.append(F.log_softmax(logits[lo:].float(), dim=-1))
    return torch.cat(out)


def ppl(logprobs: torch.Tensor, targets: torch.Tensor) -> float:
    # logprobs[t] predicts targets[t]
    return float(torch.exp(-logprobs.gather(-1, targets[:, None]).mean()))


# -- Quantized: bytes and agreement ------------------------------------------------------------------------
results["quantized"] = []
ids = text_ids[:, : args.context + args.positions]
ref = plain_logprobs(ids, args.context)
for config in quant_configs:
    t0 = time.perf_counter()
    cache = config.new_cache(model)
    with torch.inference_mode():
        model(text_ids[:, : args.mem_tokens], past_key_values=cache)
    mem = cache.memory_bytes()
    del cache
    lp = teacher_forced(ids, config.new_cache(model), args.context, args.chunk)
    top1 = float((lp.argmax(-1) == ref.argmax(-1)).float().mean())
    kl = float((ref.exp() * (ref - lp)).sum(-1).mean())
    row = {"config": config.to_dict()["kvcache"], "tokens": mem.tokens, "bytes_used": mem.used,
           "bytes_allocated": mem.allocated, "bytes_fp32": mem.dense_fp32, "ratio_vs_fp32": round(mem.ratio_fp32, 4),
           "top1_agreement": round(top1, 4), "kl": kl, "positions": lp.shape[0], "seconds": time.perf_counter() - t0}
    results["quantized"].append(row)
    print(f"int{config.bits:<2} g{config.group_size} r{config.residual_length}: {mem.used / 2**20:7.2f} MiB at "
          f"{mem.tokens} tokens = {mem.ratio_fp32:.3f}x fp32 ({mem.dense_fp32 / 2**20:.1f} MiB); top-1 agreement "
          f"{top1:.4f}, KL {kl:.2e} over {lp.shape[0]} positions after {args.context}")

# -- Sinks / HeavyHitter: perplexity far past the window, flat memory ---------------------------------------
W = args.window
ids = text_ids[:, : 4 * W]
targets = ids[0, 1:]
results["streaming"] = {"window": W, "tokens": ids.shape[1]}
full = plain_logprobs(ids, 0)[:-1]
results["streaming"]["ppl_full_context"] = ppl(full, targets)
print(f"\nperplexity over {ids.shape[1]} tokens: full context {results['streaming']['ppl_full_context']:.3f}")


def sink_positions_for(cache):
    def positions(i: int, n: int) -> dict:
        cache.make_room(n)
        return {"position_ids": cache.position_ids(n)}
    return positions


for sinks in (args.sinks, 0):
    config = Sinks(window=W, num_sink_tokens=sinks)
    cache = config.new_cache(model)
    mem = {}

    def record(seen, cache=cache, mem=mem):
        if seen in (W, 2 * W, 4 * W):
            mem[seen] = cache.memory_bytes().allocated

    t0 = time.perf_counter()
    lp = teacher_forced(ids, cache, 0, args.chunk, positions=sink_positions_for(cache), on_step=record)[:-1]
    key = f"sinks_{sinks}"
    results["streaming"][key] = {"ppl": ppl(lp, targets), "bytes_at": mem, "seconds": time.perf_counter() - t0}
    label = f"{sinks} sinks + {W - sinks} recent" if sinks else f"window of {W}, no sinks"
    print(f"  Sinks({label}): {results['streaming'][key]['ppl']:.3f}; cache bytes at "
          + ", ".join(f"{k}: {v / 2**20:.2f} MiB" for k, v in mem.items()))

config = HeavyHitter(budget=W, recent=W // 4)
use_(model, config)  # eager attention + the hooks reading its weights; undone below
cache = config.new_cache(model)
mem = {}


def record_h2o(seen):
    if seen in (W, 2 * W, 4 * W):
        mem[seen] = cache.memory_bytes().allocated


t0 = time.perf_counter()
lp = teacher_forced(ids, cache, 0, args.chunk, positions=true_positions, on_step=record_h2o)[:-1]
infopt.undo(model)
results["streaming"]["heavy_hitter"] = {"ppl": ppl(lp, targets), "bytes_at": mem, "seconds": time.perf_counter() - t0}
print(f"  HeavyHitter(budget={W}, recent={W // 4}): {results['streaming']['heavy_hitter']['ppl']:.3f}; cache bytes at "
      + ", ".join(f"{k}: {v / 2**20:.2f} MiB" for k, v in mem.items()))

if args.json:
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2, default=str)
    print(f"wrote {args.json}")
