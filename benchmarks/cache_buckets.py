"""First and second call of a compiled recipe at prompts that reach new static-cache buckets (issue: no compile while
serving). A compiled recipe warms its decode step at one length (256 slots); before the cache length was symbolic in
its AOTInductor packages, the first call in the 512 or 768 bucket exported and compiled a package inside the user's
``generate`` (about 50 s on 2 cores for the default model). Prints, per prompt length: the cache bucket, the first
and second call's seconds, and the compiles since the warm-up; ``--fixed`` runs the old way (one package per bucket)
for comparison, in the same process.

Usage: python benchmarks/cache_buckets.py [--recipe cpu-fast] [--prompts 40 300 700] [--new-tokens 64] [--fixed]
    [--json out.json]

Run it with an empty ``INFOPT_CACHE_DIR`` (``INFOPT_CACHE_DIR=$(mktemp -d) python benchmarks/cache_buckets.py ...``):
packages cached on disk by an earlier run would spare the fixed-length model its compiles.
"""

import argparse
import json
import time

import torch

import infopt
from infopt.compile import compile_stats
from infopt.compile import decoder as compiled_decoder
from infopt.generate import decoder_for
from infopt.models import load_default


def build(recipe, fixed: bool):
    """The default model with ``recipe`` applied: ``(model, seconds to apply)``. ``fixed``: its compiled forward keeps
    no size symbolic (one graph or package per batch size and cache bucket, the old way)."""
    init = compiled_decoder.CompiledForward.__init__
    if fixed:
        def one_per_shape(self, *a, **k):
            init(self, *a, **k)
            self.free_length = False

        compiled_decoder.CompiledForward.__init__ = one_per_shape
    try:
        model, _ = load_default()
        t0 = time.perf_counter()
        model = infopt.optimize(model, recipe)
        return model, time.perf_counter() - t0
    finally:
        compiled_decoder.CompiledForward.__init__ = init


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--recipe", default="cpu-fast")
    p.add_argument("--prompts", type=int, nargs="+", default=[40, 300, 700])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--fixed", action="store_true", help="also a model whose packages fix the cache length (the old way)")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    def run(model, ids) -> float:
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
        return time.perf_counter() - t0

    results = {}
    for name in (("symbolic", "fixed") if args.fixed else ("symbolic",)):
        model, apply_s = build(args.recipe, name == "fixed")
        rows = []
        g = torch.Generator().manual_seed(0)
        for n in args.prompts:
            ids = torch.randint(100, 10000, (1, n), generator=g)
            first, second = run(model, ids), run(model, ids)
            stats = compile_stats(model)
            rows.append({"prompt": n, "cache": decoder_for(model).cache.allocation().length,
                         "first_s": round(first, 2), "second_s": round(second, 2),
                         "compiles_after_warmup": stats.compiles_after_warmup})
            print(name, rows[-1], flush=True)
        results[name] = {"apply_s": round(apply_s, 1), "shapes": compile_stats(model).shapes, "calls": rows}

    from infopt.bench import machine_info

    doc = {"machine": machine_info("cpu"), "recipe": args.recipe, "new_tokens": args.new_tokens, "threads":
           torch.get_num_threads(), **results}
    print(json.dumps(doc, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
