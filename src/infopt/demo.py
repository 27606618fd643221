"""The main demo: the embedded default model, one recipe, a chat answer, and a measured before/after table.

Plain and optimized decode are timed in alternating rounds (plain, optimized, optimized, plain, ...) on two copies
of the model in one process, so a slow moment of the machine lands on both sides; the table gives the median of the
rounds and their spread, and says when rounds disagree by more than 20%.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch

from . import optimize
from .core.introspect import param_bytes
from .eval import compare, reference_logits
from .eval.answers import CHAT_PROMPTS, answer_agreement, chat_ids, reference_answers
from .models import load_default

__all__ = ["main", "measure_decode", "interleaved_rates", "SPREAD_WARNING"]

QUESTION = "Give me three short tips for writing clear Python code."
SPREAD_WARNING = 1.2
"""Rounds of one side whose fastest is more than this times its slowest make the demo say the machine was busy."""


@torch.inference_mode()
def _rate(model, input_ids: torch.Tensor, max_new_tokens: int) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    out = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)
    return (out.shape[1] - input_ids.shape[1]) / (time.perf_counter() - t0), out


@torch.inference_mode()
def measure_decode(model, input_ids: torch.Tensor, *, max_new_tokens: int, repeats: int) -> tuple[float, torch.Tensor]:
    """Median generated tokens/s over ``repeats`` greedy runs (after one warm-up), and the last output."""
    model.generate(input_ids, max_new_tokens=8, do_sample=False)  # warm-up
    rates, out = [], None
    for _ in range(repeats):
        r, out = _rate(model, input_ids, max_new_tokens)
        rates.append(r)
    return statistics.median(rates), out


@torch.inference_mode()
def interleaved_rates(models: dict[str, torch.nn.Module], input_ids: torch.Tensor, *, max_new_tokens: int,
                      rounds: int) -> tuple[dict[str, list[float]], dict[str, torch.Tensor]]:
    """Greedy tokens/s of each model, one run per model per round, the order reversed every other round so neither
    side always runs first (after one warm-up call each).

    Returns:
        ``({name: [tokens/s per round]}, {name: the last output})``.
    """
    names = list(models)
    for m in models.values():
        m.generate(input_ids, max_new_tokens=8, do_sample=False)  # warm-up
    rates: dict[str, list[float]] = {n: [] for n in names}
    outs: dict[str, torch.Tensor] = {}
    for r in range(rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            rate, outs[n] = _rate(models[n], input_ids, max_new_tokens)
            rates[n].append(rate)
    return rates, outs


def _spread(rates: list[float]) -> str:
    return f"{min(rates):.1f}-{max(rates):.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="infopt demo", description=__doc__)
    p.add_argument("--recipe", default="cpu-fast", help="preset name or recipe file (default: cpu-fast)")
    p.add_argument("--question", default=QUESTION)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--rounds", "--repeats", dest="rounds", type=int, default=5,
                   help="alternating timing rounds of plain and optimized decode (default 5)")
    p.add_argument("--answers", type=int, default=len(CHAT_PROMPTS),
                   help=f"built-in chat questions whose greedy answers are compared (0-{len(CHAT_PROMPTS)})")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device cpu", flush=True)
    t0 = time.perf_counter()
    model, tok = load_default()
    print(f"loaded SmolLM2-135M-Instruct (embedded default model) in {time.perf_counter() - t0:.1f}s", flush=True)
    ids = chat_ids(tok, args.question)
    prompts = CHAT_PROMPTS[:max(0, args.answers)]

    print("measuring the original model's reference (logits on pydoc text, chat answers)...", flush=True)
    mem0 = param_bytes(model)
    ref = reference_logits(model, tokenizer=tok, max_tokens=512)
    ref_answers = reference_answers(model, tok, prompts) if prompts else []
    plain = copy.deepcopy(model)  # the baseline stays alive beside the optimized model: rounds interleave

    t1 = time.perf_counter()
    optimize(model, args.recipe)
    t_opt = time.perf_counter() - t1
    mem1 = param_bytes(model)
    print(f"\nrecipe: {args.recipe}  ({' -> '.join(s.key for s in model.infopt.steps)}), applied in {t_opt:.1f}s",
          flush=True)
    print(f"timing {args.rounds} alternating rounds of plain and optimized decode...", flush=True)
    rates, outs = interleaved_rates({"plain": plain, "infopt": model}, ids, max_new_tokens=args.max_new_tokens,
                                    rounds=args.rounds)
    q = compare(model, ref)
    agreement = answer_agreement(model, tok, ref_answers, prompts) if prompts else None

    def answer(out: torch.Tensor) -> str:
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()

    print(f"\nQ: {args.question}\nA (plain HF): {answer(outs['plain'])}\nA (infopt):   {answer(outs['infopt'])}\n")
    tps0, tps1 = statistics.median(rates["plain"]), statistics.median(rates["infopt"])
    mb = 2**20
    rows = [
        (f"decode tokens/s (median of {args.rounds})", f"{tps0:.1f}", f"{tps1:.1f}", f"{tps1 / tps0:.2f}x"),
        ("  spread over the rounds", _spread(rates["plain"]), _spread(rates["infopt"]), ""),
        ("weights+buffers MiB", f"{mem0 / mb:.1f}", f"{mem1 / mb:.1f}", f"{mem1 / mem0:.2f}x"),
        ("KL vs original (nats/token)", "0", f"{q['kl']:.4f}", ""),
        ("top-1 agreement", "1.000", f"{q['top1']:.3f}", ""),
        ("perplexity (pydoc text)", f"{q['ppl_ref']:.2f}", f"{q['ppl']:.2f}", f"{q['ppl'] / q['ppl_ref']:.3f}x"),
        ("greedy answer identical", "", "yes" if torch.equal(outs["plain"], outs["infopt"]) else "no", ""),
    ]
    if agreement is not None:
        rows.append((f"chat answers identical (of {agreement.total})", "", f"{agreement.same}", ""))
    w = max(len(r[0]) for r in rows)
    print(f"{'':<{w}}  {'plain HF':>10}  {'infopt':>10}  {'ratio':>7}")
    for name, a, b, r in rows:
        print(f"{name:<{w}}  {a:>10}  {b:>10}  {r:>7}")
    print(f"\nKL/top-1/perplexity on {q['tokens']} tokens of Python's pydoc text; tokens/s from greedy generation of "
          f"up to {args.max_new_tokens} tokens, batch 1, both models in this process, rounds alternated.")
    if agreement is not None and agreement.same < agreement.total:
        print(f"chat answers: {agreement}. A lossy recipe moves every token's distribution a little (the KL above); "
              "where the original's top two tokens were close, a greedy answer takes the other one and goes on "
              "from there. docs/getting-started.md#what-quality-you-lose-and-how-to-get-it-back lists the knobs.")
    busy = [n for n, r in rates.items() if max(r) > SPREAD_WARNING * min(r)]
    if busy:
        print(f"note: the {' and '.join(busy)} rounds differ by more than {SPREAD_WARNING - 1:.0%} (fastest against "
              "slowest): the machine was busy while timing; run again on a quiet machine for steadier figures.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
