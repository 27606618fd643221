"""What ``Engine(batch_invariant=True)`` costs: output tokens/s of the engine's eager steps with and without the mode,
on the default model, in one process (:mod:`infopt.batching.invariant`).

Usage:
    python benchmarks/batch_invariant.py --requests 32 --new-tokens 32 --repeats 3 --json out.json

Requests are random token ids (prompt lengths drawn from 16 to 256, one seed), all queued before the first step,
``ignore_eos`` so every request produces ``--new-tokens``. The rows alternate the two engines and repeat; figures are
medians. Both engines run eagerly (the mode does not compile); without the mode the engine prepacks its linears (its
default on a CPU). Each row also says whether every request's greedy tokens equal the other engine's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import infopt
from infopt.batching import Engine, SamplingParams, invariant
from infopt.bench.harness import machine_info
from infopt.kvcache import Paged
from infopt.models import load_default


def serve(model, prompts, new_tokens: int, invariant: bool) -> tuple[float, list[list[int]], dict]:
    engine = Engine(model, max_batch_tokens=512, max_seqs=64, batch_invariant=invariant,
                    kv=Paged(num_blocks=2048, prefix_caching=False))
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    seconds = time.perf_counter() - t0
    metrics = engine.core.metrics()
    infopt.undo(model)
    return sum(len(o.token_ids) for o in outs) / seconds, [o.token_ids for o in outs], metrics


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--rows", type=int, default=None, help="rows per matrix product in the mode (default: its ROWS)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.rows:
        invariant.ROWS = args.rows
    model, _ = load_default(dtype=getattr(torch, args.dtype))
    model.eval()
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (int(torch.randint(16, 257, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.requests)]
    rates: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, list] = {}
    steps: dict[bool, int] = {}
    serve(model, prompts[:2], 2, False)  # warm-up: kernels built, allocator primed
    for _ in range(args.repeats):
        for on in (False, True):
            rate, toks, metrics = serve(model, prompts, args.new_tokens, on)
            rates[on].append(rate)
            tokens[on] = toks
            steps[on] = metrics["steps"]
            print(f"batch_invariant={on}: {rate:.1f} output tok/s ({metrics['steps']} steps)", flush=True)
    plain, inv = statistics.median(rates[False]), statistics.median(rates[True])
    same = sum(a == b for a, b in zip(tokens[False], tokens[True], strict=True))
    result = {"machine": machine_info("cpu"), "dtype": args.dtype, "requests": args.requests, "rows": invariant.ROWS,
              "new_tokens": args.new_tokens, "repeats": args.repeats,
              "output_tok_s": {"default": round(plain, 1), "batch_invariant": round(inv, 1)},
              "ratio": round(inv / plain, 3), "steps": {"default": steps[False], "batch_invariant": steps[True]},
              "greedy_identical_requests": same, "all_rates": {str(k): v for k, v in rates.items()}}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
