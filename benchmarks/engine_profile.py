"""Where an engine step's time goes, by category, at 1, 8, 32 and 64 running sequences (fp32 and bf16).

Each sequence holds a prompt of ``--context`` tokens and then decodes; once every sequence is decoding, ``--steps``
decode steps are timed. Categories are timed by wrapping the functions that do the work (perf_counter around
synchronous CPU calls):

- linears: every ``nn.Linear`` (and quantized linear) forward, the LM head included;
- attention: the paged attention function (reading K/V through the block tables);
- kv_write: writing each layer's new K/V into the blocks (``PagedStep.write``);
- schedule+layout: the scheduler's ``next_step`` (admission, the step's token lists, the block tables and
  attention metadata built by ``PagedCache.begin_step``);
- sampling: choosing the next tokens from the logits;
- other: the rest of the step (norms, rotary embeddings, activations, residual adds, Python in the model).

    python benchmarks/engine_profile.py [--dtypes float32 bfloat16] [--seqs 1 8 32 64] [--quantize none smoothquant]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch
from engine_throughput import QUANTIZE, load_quantized  # this folder: the throughput benchmark
from torch import nn

from infopt.attention import paged as paged_mod
from infopt.batching import Engine, SamplingParams
from infopt.batching import core as core_mod
from infopt.kvcache import Paged

CATEGORIES = ("linears", "attention", "kv_write", "schedule+layout", "sampling", "other")


class Timers:
    def __init__(self):
        self.t: dict[str, float] = defaultdict(float)
        self.on = False

    def wrap(self, owner, name: str, cat: str):
        fn = getattr(owner, name)

        def timed(*a, **k):
            if not self.on:
                return fn(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[cat] += time.perf_counter() - t0

        setattr(owner, name, timed)
        return fn

    def hook_linears(self, model: nn.Module):
        def pre(mod, args):
            mod._t0 = time.perf_counter()

        def post(mod, args, out):
            if self.on:
                self.t["linears"] += time.perf_counter() - mod._t0

        for m in model.modules():
            if isinstance(m, nn.Linear) or type(m).__name__.endswith("Linear"):
                m.register_forward_pre_hook(pre)
                m.register_forward_hook(post)


def profile(dtype: torch.dtype, seqs: list[int], context: int, steps: int, quantize: str = "none") -> list[dict]:
    model, tok = load_quantized(dtype, quantize)
    timers = Timers()
    timers.hook_linears(model)
    timers.wrap(paged_mod, "_reference", "attention")
    timers.wrap(paged_mod, "_cpu", "attention")
    timers.wrap(paged_mod.PagedStep, "write", "kv_write")
    timers.wrap(core_mod, "choose_tokens", "sampling")
    rows = []
    for s in seqs:
        engine = Engine(model, tok, kv=Paged(num_blocks=-(-s * (context + steps + 8) // 16) + 8, prefix_caching=False),
                        max_seqs=max(seqs))
        timers.wrap(engine.scheduler, "next_step", "schedule+layout")
        prompts = [[(7 * i + j) % 30000 + 100 for j in range(context)] for i in range(s)]
        handles = [engine.submit(p, SamplingParams(max_new_tokens=steps + 64, ignore_eos=True)) for p in prompts]
        while any(not h._seq.output for h in handles):  # every sequence past its prefill
            engine.step()
        for _ in range(3):
            engine.step()
        per_step = []
        timers.t.clear()
        timers.on = True
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            per_step.append(time.perf_counter() - t0)
        timers.on = False
        for h in handles:
            h.cancel()
        engine.step()
        total = sum(per_step)
        cat = {k: timers.t.get(k, 0.0) for k in CATEGORIES[:-1]}
        cat["other"] = total - sum(cat.values())
        row = {"dtype": str(dtype).replace("torch.", ""), "quantize": quantize, "seqs": s, "context": context,
               "step_ms_median": 1e3 * statistics.median(per_step),
               "tokens_per_s": s * steps / total,
               "ms_per_step": {k: 1e3 * v / steps for k, v in cat.items()}}
        rows.append(row)
        shares = "  ".join(f"{k} {v:6.1f}" for k, v in row["ms_per_step"].items())
        print(f"{row['dtype']:8s} {quantize:11s} {s:3d} seqs: {row['step_ms_median']:7.1f} ms/step  {row['tokens_per_s']:6.1f} tok/s "
              f"| ms/step: {shares}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--seqs", nargs="+", type=int, default=[1, 8, 32, 64])
    ap.add_argument("--context", type=int, default=256, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed")
    ap.add_argument("--quantize", nargs="+", default=["none"], choices=QUANTIZE,
                    help="quantization applied first, one model each (as in engine_throughput.py)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for d in args.dtypes:
        for q in args.quantize:
            rows += profile(getattr(torch, d), args.seqs, args.context, args.steps, q)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
