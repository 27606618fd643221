"""The batching engine's sustained throughput on the ``throughput`` workload (64 chat requests at once, 16,002 prompt
and 9,094 output tokens, EOS ignored), per dtype and paged-attention kernel, in one process.

Reports output and prompt tokens/s, wall time and KV-cache utilisation; ``--check N`` also decodes the first N
requests with plain ``generate`` (greedy, same dtype) and counts those whose tokens are identical.

    python benchmarks/engine_throughput.py [--dtypes float32 bfloat16] [--kernels cpu reference] [--check 4]
        [--prepack off auto] [--quantize none int8 int4 smoothquant] [--compile off on] [--max-batch-tokens 512 2048]
        [--json benchmarks/results/engine_throughput.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from infopt.attention.paged import kernel_calls, set_cpu_kernel
from infopt.batching import Engine, SamplingParams
from infopt.bench.harness import machine_info
from infopt.bench.workloads import WORKLOADS, make_workload
from infopt.kvcache import Paged
from infopt.models import load_default

QUANTIZE = ("none", "int8", "int4", "smoothquant")
"""The ``--quantize`` choices (also engine_profile.py's)."""


def load_quantized(dtype: torch.dtype, quantize: str):
    """The default model in ``dtype`` with ``quantize`` applied (one of :data:`QUANTIZE`): int8 / int4 (g64)
    weight-only with their ``activations="auto"`` default, or SmoothQuant W8A8. Returns ``(model, tokenizer)``."""
    model, tok = load_default()
    model = model.to(dtype)
    if quantize != "none":
        import infopt
        from infopt.quantize import Int4WeightOnly, Int8WeightOnly, SmoothQuantW8A8

        step = {"int8": Int8WeightOnly, "int4": lambda: Int4WeightOnly(group_size=64),
                "smoothquant": SmoothQuantW8A8}[quantize]()
        infopt.optimize(model, [step], tokenizer=tok)
    return model, tok


def run(model, tok, reqs, kernel: str, prepack: str, compile: bool = False, max_batch_tokens: int = 512) -> dict:
    previous = set_cpu_kernel(kernel == "cpu")
    try:
        t0 = time.perf_counter()
        engine = Engine(model, tok, kv=Paged(prefix_caching=False), prepack=None if prepack == "auto" else False,
                        compile=compile, max_batch_tokens=max_batch_tokens)
        engine.generate([reqs[0].input_ids[0]], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
        start_s = time.perf_counter() - t0
        engine.core.reset_stats()
        before = kernel_calls()
        t0 = time.perf_counter()
        outs = engine.generate([r.input_ids[0] for r in reqs],
                               [SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=True) for r in reqs])
        wall = time.perf_counter() - t0
        calls = {k: v - before[k] for k, v in kernel_calls().items() if v - before[k]}
    finally:
        set_cpu_kernel(previous)
    m = engine.metrics()
    out_tokens = sum(len(o.token_ids) for o in outs)
    prompt_tokens = sum(r.prompt_len for r in reqs)
    return {"kernel": kernel, "compile": compile, "max_batch_tokens": max_batch_tokens, "engine_start_s": start_s, "compile_stats": m.get("compile"),
            "prepacked_linears": engine.prepacked if prepack == "auto" else 0, "wall_s": wall,
            "output_tokens": out_tokens, "prompt_tokens": prompt_tokens,
            "output_tokens_per_s": out_tokens / wall, "prompt_tokens_per_s": prompt_tokens / wall,
            "steps": m["steps"], "kv_util_mean": m["kv_util_mean"], "kv_util_max": m["kv_util_max"],
            "attention_calls": calls, "tokens": [o.token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--kernels", nargs="+", default=["cpu"], choices=["cpu", "reference"])
    ap.add_argument("--prepack", nargs="+", default=["auto"], choices=["auto", "off"],
                    help="the engine's prepacked linear weights: auto (its default) and/or off; run off first")
    ap.add_argument("--quantize", nargs="+", default=["none"], choices=QUANTIZE,
                    help="quantization applied first, one model each: int8/int4 weight-only (activations as their "
                         "'auto' default), smoothquant (W8A8: int8 weights x per-token int8 activations)")
    ap.add_argument("--compile", nargs="+", default=["off"], choices=["off", "on"],
                    help="Engine(compile=...): the eager step and/or the compiled one (each 'on' row gets a freshly "
                         "loaded model, since compiling packs its linears in place)")
    ap.add_argument("--max-batch-tokens", nargs="+", type=int, default=[512],
                    help="Engine(max_batch_tokens=...): tokens per step (prompt chunks and decode tokens), one row each")
    ap.add_argument("--check", type=int, default=0, help="compare the first N requests with plain generate")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for dname, qname in [(d, q) for d in args.dtypes for q in args.quantize]:
        model, tok = load_quantized(getattr(torch, dname), qname)
        reqs = make_workload("throughput", tok, num_requests=args.num_requests)
        refs = []
        for r in reqs[:args.check]:
            with torch.no_grad():
                out = model.generate(r.input_ids, max_new_tokens=r.max_new_tokens, min_new_tokens=r.max_new_tokens,
                                     do_sample=False, pad_token_id=tok.pad_token_id or 0)
            refs.append(out[0, r.prompt_len:].tolist())
        for kernel, prepack, comp, mbt in [(k, p, c, t) for c in args.compile for p in args.prepack
                                           for k in args.kernels for t in args.max_batch_tokens]:
            if comp == "on":
                model, tok = load_quantized(getattr(torch, dname), qname)
            row = run(model, tok, reqs, kernel, prepack, comp == "on", mbt)
            row["dtype"] = dname
            row["prepack"] = prepack
            row["quantize"] = qname
            if refs:
                row["greedy_identical"] = f"{sum(a == b for a, b in zip(refs, row['tokens'], strict=False))}/{len(refs)}"
                # where each differing request first leaves plain generate's tokens (of how many)
                row["first_divergence"] = [
                    f"{next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)}/{len(a)}"
                    for a, b in zip(refs, row["tokens"], strict=False) if a != b]
            row.pop("tokens")  # compared above; not written to the JSON
            rows.append(row)
            print(f"{dname:8s} {qname:11s} kernel {kernel:9s} prepack {prepack:4s} compile {comp:3s} tokens/step {mbt}: "
                  f"{row['output_tokens_per_s']:6.1f} output tok/s, engine start {row['engine_start_s']:.0f} s,"
                  f" {row['prompt_tokens_per_s']:6.1f} prompt tok/s, {row['wall_s']:.1f} s, {row['steps']} steps, "
                  f"KV util mean {row['kv_util_mean']:.2f} max {row['kv_util_max']:.2f}"
                  + (f", greedy identical {row['greedy_identical']} (first differing token: "
                     f"{', '.join(row['first_divergence']) or '-'})" if refs else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(torch.device("cpu")), "workload": WORKLOADS["throughput"],
                       "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
