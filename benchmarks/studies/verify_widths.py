"""Which verify widths a speculative target's warm-up should compile: ``cpu-lossless`` on the default model with the
narrowest multi-token graph at 4 tokens (``MIN_VERIFY_WIDTH``, the library's choice: verify graphs of 1, 4, 8
tokens) against 2 (graphs of 1, 2, 4, 8: one AOTInductor package more), in alternating processes.

Each process applies the preset (packages from the disk cache after the first process of each side), then times
the target's compiled step at 1, 2, 3, 4, 5 and 8 tokens on a 256-slot cache (15 rounds, the widths alternating
within each round; a step of 3 tokens runs the 4-token graph padded, 5 the 8-token one), and decodes the built-in
chat questions greedily (96 new tokens each: tokens/s as ``(n - 1) / (t(n) - t(1))``), keeping the tokens.

    python benchmarks/studies/verify_widths.py [--rounds 3] [--json benchmarks/results/verify_widths.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _common
WIDTHS = (1, 2, 3, 4, 5, 8)


def child(min_width: int, questions: int, new_tokens: int) -> dict:
    import torch
    from _common import decode_rate

    import infopt
    from infopt.compile import compile_stats, step
    from infopt.eval import CHAT_PROMPTS, chat_ids
    from infopt.generate import decoder_for, rollback
    from infopt.models import load_default

    step.MIN_VERIFY_WIDTH = min_width  # the warm-up's plan reads it from here
    model, tok = load_default()
    t = time.perf_counter()
    infopt.optimize(model, "cpu-lossless")
    apply_s = time.perf_counter() - t
    dec = decoder_for(model)
    fwd = dec.forward_for(model)
    cache = dec.cache.cache_for(model, 1, 256)
    with torch.no_grad():
        ids = torch.full((1, 100), 1, dtype=torch.long)
        fwd.prefill(ids, torch.arange(100)[None], None, cache)
        times: dict[int, list[float]] = {k: [] for k in WIDTHS}
        for _ in range(15):
            for k in WIDTHS:
                pos = torch.arange(100, 100 + k)
                args = (torch.full((1, k), 5, dtype=torch.long), pos[None].contiguous(), pos, None, cache)
                t0 = time.perf_counter()
                fwd.step(*args)
                times[k].append(time.perf_counter() - t0)
                rollback(cache, k)
    rates, tokens = [], []
    for q in CHAT_PROMPTS[:questions]:
        rate, out = decode_rate(model, chat_ids(tok, q), new_tokens)
        rates.append(rate)
        tokens.append(out[0].tolist())
    stats = compile_stats(model)
    return {"min_width": min_width, "apply_s": apply_s, "graphs": stats.shapes,
            "compiles_after_warmup": stats.compiles_after_warmup, "cold_eager_calls": stats.cold_eager_calls,
            "step_ms": {k: 1e3 * statistics.median(v[3:]) for k, v in times.items()},
            "decode_tokens_per_s": statistics.median(rates), "tokens": tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--json")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.questions, args.new_tokens)))
        return
    rounds = []
    for r in range(args.rounds):
        got = {}
        for w in ((4, 2) if r % 2 == 0 else (2, 4)):
            out = subprocess.run([sys.executable, __file__, "--child", str(w), "--questions", str(args.questions),
                                  "--new-tokens", str(args.new_tokens)], capture_output=True, text=True, check=True)
            got[w] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"round {r} min_width {w}: decode {got[w]['decode_tokens_per_s']:.1f} tok/s, step ms "
                  f"{ {k: round(v, 1) for k, v in got[w]['step_ms'].items()} }, {len(got[w]['graphs'])} graphs",
                  flush=True)
        rounds.append(got)
    med = {w: {"decode_tokens_per_s": statistics.median(g[w]["decode_tokens_per_s"] for g in rounds),
               "step_ms": {k: statistics.median(g[w]["step_ms"][k] for g in rounds) for k in rounds[0][w]["step_ms"]},
               "graphs": len(rounds[0][w]["graphs"])} for w in (4, 2)}
    ratio = statistics.median(g[4]["decode_tokens_per_s"] / g[2]["decode_tokens_per_s"] for g in rounds)
    same = sum(a == b for a, b in zip(rounds[0][4]["tokens"], rounds[0][2]["tokens"], strict=True))
    result = {"median": med, "decode_ratio_4_over_2": ratio, "identical_answers": f"{same} of {args.questions}",
              "rounds": rounds}
    from infopt.bench.harness import machine_info

    result["machine"] = machine_info()
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
