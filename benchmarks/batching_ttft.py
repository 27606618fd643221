"""Time to first token of short requests arriving behind a 2,000-token prompt, with and without chunked prefill.

For each of N short chat requests: a fresh arrival of the long prompt and the short request at the same
moment (the long one first in the queue), timed until the short request's first token; compared with the
same short request served alone. The engine runs without prefix caching so every trial prefills the long
prompt from scratch. HF sequential generate is the reference: there the short request waits for the long
one's whole generation.

    python benchmarks/batching_ttft.py                       # default model, chunk sizes 64,128,256
    python benchmarks/batching_ttft.py --tiny --shorts 2     # smoke run
    python benchmarks/batching_ttft.py --compile --chunks 64 --no-unchunked   # the compiled engine step
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from infopt.batching import Engine, SamplingParams
from infopt.bench.harness import machine_info
from infopt.kvcache import Paged


def _pct(xs, q):
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--shorts", type=int, default=8)
    ap.add_argument("--long", type=int, default=2000, help="long prompt tokens")
    ap.add_argument("--chunks", default="64,128,256", help="prefill_chunk values to try")
    ap.add_argument("--budget", type=int, default=512, help="max_batch_tokens")
    ap.add_argument("--compile", action="store_true", help="Engine(compile=True) (each engine compiles at start)")
    ap.add_argument("--no-unchunked", action="store_true", help="skip the run with chunked prefill off")
    ap.add_argument("--json", default="benchmarks/results/batching_ttft.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.tiny:
        from infopt.models import load_default_tokenizer, tiny_model

        model, tok = tiny_model(max_positions=4096), load_default_tokenizer()
    else:
        from infopt.models import load_default

        model, tok = load_default()
    from infopt.bench.workloads import _chat, _corpus_ids

    ids = _corpus_ids(tok, args.long + 4000)
    long_prompt = ids[:args.long]
    shorts = [_chat(tok, "Explain briefly: " + tok.decode(ids[3000 + 40 * i:3000 + 40 * i + 24]))[0].tolist()
              for i in range(args.shorts)]
    long_p, short_p = SamplingParams(max_new_tokens=16, ignore_eos=True), SamplingParams(max_new_tokens=8,
                                                                                         ignore_eos=True)
    results = {"machine": machine_info(), "long_prompt_tokens": len(long_prompt),
               "short_prompt_tokens": [len(s) for s in shorts], "max_batch_tokens": args.budget,
               "compile": args.compile, "modes": {}}

    def engine(chunked: bool, chunk: int | None) -> Engine:
        return Engine(model, tok, max_batch_tokens=args.budget, max_seqs=16, chunked_prefill=chunked,
                      prefill_chunk=chunk, kv=Paged(num_blocks=(args.long + 600) // 16 + 8, prefix_caching=False),
                      compile=args.compile)

    # solo TTFT of each short request (median of 3)
    e = engine(True, None)
    e.generate([shorts[0]], short_p)  # warm-up
    solo = []
    for s in shorts:
        ts = []
        for _ in range(3):
            ts.append(e.generate([s], short_p)[0].metrics.ttft)
        solo.append(statistics.median(ts))
    results["solo_ttft_ms"] = [1e3 * t for t in solo]
    modes = [("chunked", True, int(c)) for c in args.chunks.split(",")] + \
        ([] if args.no_unchunked else [("unchunked", False, None)])
    for name, chunked, chunk in modes:
        e = engine(chunked, chunk)
        behind, long_ttft = [], []
        for s in shorts:
            hl = e.submit(long_prompt, long_p)
            hs = e.submit(s, short_p)
            out = hs.result()
            long_ttft.append(hl.result().metrics.ttft)
            behind.append(out.metrics.ttft)
        ratios = [b / a for b, a in zip(behind, solo, strict=True)]
        key = f"{name}-{chunk}" if chunk else name
        results["modes"][key] = {"ttft_ms": [1e3 * t for t in behind], "ratio_to_solo": ratios,
                                 "ratio_p50": _pct(ratios, 0.5), "ratio_p90": _pct(ratios, 0.9),
                                 "ttft_p90_ms": 1e3 * _pct(behind, 0.9),
                                 "long_ttft_p50_ms": 1e3 * statistics.median(long_ttft)}
        print(f"{key:>14}: short TTFT p90 {1e3 * _pct(behind, 0.9):8.0f} ms, ratio to solo p50 "
              f"{_pct(ratios, 0.5):5.2f}x p90 {_pct(ratios, 0.9):5.2f}x; long prompt TTFT p50 "
              f"{1e3 * statistics.median(long_ttft):.0f} ms")
    # HF sequential: the short request starts after the long one's generate returns
    gen = []
    with torch.no_grad():
        model.generate(torch.tensor([shorts[0]]), max_new_tokens=2, do_sample=False)
        for s in shorts[:2]:
            t0 = time.perf_counter()
            model.generate(torch.tensor([long_prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
            t1 = time.perf_counter()
            model.generate(torch.tensor([s]), max_new_tokens=1, do_sample=False)
            gen.append((time.perf_counter() - t0, time.perf_counter() - t1))
    results["hf_sequential_short_ttft_ms"] = [1e3 * a for a, _ in gen]
    print(f"  solo TTFT p50 {1e3 * statistics.median(solo):.0f} ms; HF sequential short TTFT behind the long "
          f"generate {1e3 * statistics.median(a for a, _ in gen):.0f} ms")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
