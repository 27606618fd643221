"""The main demo: the embedded default model, one recipe, a chat answer, and a measured before/after table."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from . import optimize
from .core.introspect import param_bytes
from .eval import compare, reference_logits

__all__ = ["main", "measure_decode"]

QUESTION = "Give me three short tips for writing clear Python code."


def _chat_ids(tokenizer, question: str) -> torch.Tensor:
    msgs = [{"role": "user", "content": question}]
    enc = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return enc["input_ids"]


@torch.inference_mode()
def measure_decode(model, input_ids: torch.Tensor, *, max_new_tokens: int, repeats: int) -> tuple[float, torch.Tensor]:
    """Median generated tokens/s over ``repeats`` greedy runs (after one warm-up), and the last output."""
    model.generate(input_ids, max_new_tokens=8, do_sample=False)  # warm-up
    rates, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)
        dt = time.perf_counter() - t0
        rates.append((out.shape[1] - input_ids.shape[1]) / dt)
    return statistics.median(rates), out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="infopt demo", description=__doc__)
    p.add_argument("--recipe", default="cpu-fast", help="preset name or recipe file (default: cpu-fast)")
    p.add_argument("--question", default=QUESTION)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    from .models import load_default

    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device cpu")
    t0 = time.perf_counter()
    model, tok = load_default()
    print(f"loaded SmolLM2-135M-Instruct (embedded default model) in {time.perf_counter() - t0:.1f}s")
    ids = _chat_ids(tok, args.question)

    mem0 = param_bytes(model)
    tps0, out0 = measure_decode(model, ids, max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    ref = reference_logits(model, tokenizer=tok, max_tokens=512)

    t1 = time.perf_counter()
    optimize(model, args.recipe)
    t_opt = time.perf_counter() - t1
    mem1 = param_bytes(model)
    tps1, out1 = measure_decode(model, ids, max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    q = compare(model, ref)

    answer = tok.decode(out1[0, ids.shape[1]:], skip_special_tokens=True).strip()
    same = torch.equal(out0, out1)
    print(f"\nrecipe: {args.recipe}  ({model.infopt.steps and ' -> '.join(s.key for s in model.infopt.steps)}), "
          f"applied in {t_opt:.1f}s")
    print(f"\nQ: {args.question}\nA: {answer}\n")
    mb = 2**20
    rows = [
        (f"decode tokens/s (median of {args.repeats})", f"{tps0:.1f}", f"{tps1:.1f}", f"{tps1 / tps0:.2f}x"),
        ("weights+buffers MiB", f"{mem0 / mb:.1f}", f"{mem1 / mb:.1f}", f"{mem1 / mem0:.2f}x"),
        ("KL vs original (nats/token)", "0", f"{q['kl']:.4f}", ""),
        ("top-1 agreement", "1.000", f"{q['top1']:.3f}", ""),
        ("perplexity (pydoc text)", f"{q['ppl_ref']:.2f}", f"{q['ppl']:.2f}", f"{q['ppl'] / q['ppl_ref']:.3f}x"),
        ("greedy answer identical", "", "yes" if same else "no", ""),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"{'':<{w}}  {'plain HF':>10}  {'infopt':>10}  {'ratio':>7}")
    for name, a, b, r in rows:
        print(f"{name:<{w}}  {a:>10}  {b:>10}  {r:>7}")
    print(f"\nKL/top-1/perplexity on {q['tokens']} tokens of Python's pydoc text; tokens/s from greedy "
          f"generation of up to {args.max_new_tokens} tokens, batch 1, same process.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
