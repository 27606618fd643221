"""How much an AOTInductor-compiled decode step would gain over ``cpu-fast``'s compiled step (a measurement, not a
feature: nothing in the library calls AOTInductor yet).

``cpu-fast``'s decode step is a ``torch.compile``-d graph whose Python wrapper calls, per decoder layer, five infopt
operators and four generated kernels; with the dynamo frame and the gathering of its inputs that is Python work every
token. AOTInductor compiles the same forward into one shared library whose wrapper is C++. This script exports the
default model's one-token forward (after ``cpu-fast``'s quantize step: int4 g32 weights with int8 activations, the
int8 head) with the static cache's key/value tensors as inputs that the step mutates in place (``torch.export``,
non-strict; transformers' ``TorchExportableModuleWithStaticCache`` exports only in strict mode and keeps the cache
inside the package, and a cache object as an input is refused), compiles it with
``torch._inductor.aoti_compile_and_package`` and the same graph pass that fuses q/k/v and gate/up
(:class:`infopt.compile.passes.FuseSharedInputLinears`), and then, alternating in one process:

- times ``--tokens`` greedy tokens through the AOTInductor step (a Python loop: argmax, next call) against
  ``cpu-fast``'s ``generate`` (its prompt time subtracted);
- compares the AOTInductor step's logits, teacher-forced along ``cpu-fast``'s greedy tokens, with ``cpu-fast``'s own
  decode path (:func:`infopt.eval.decode_path_logits`): KL and top-1.

The exported graph attends with SDPA over transformers' static cache where ``cpu-fast`` calls infopt's paged kernel,
so the two are not bit-identical.

Usage:
    python benchmarks/studies/aoti_decode.py [--rounds 6] [--tokens 128] [--json out.json]
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import infopt
from infopt.bench.harness import machine_info
from infopt.eval import decode_path_logits, logit_metrics
from infopt.models import load_default

p = argparse.ArgumentParser()
p.add_argument("--rounds", type=int, default=6)
p.add_argument("--tokens", type=int, default=128)
p.add_argument("--cache-length", type=int, default=256)
p.add_argument("--json", default=None)
args = p.parse_args()


class OneTokenStep(nn.Module):
    """The model's forward on a transformers ``StaticCache`` whose layers read and write the tensors passed in."""

    def __init__(self, model, cache):
        super().__init__()
        self.model, self.cache = model, cache

    def forward(self, input_ids, cache_position, keys, values):
        for layer, k, v in zip(self.cache.layers, keys, values, strict=True):
            layer.keys, layer.values = k, v
            layer.cumulative_length = cache_position[0].clone()
        return self.model(input_ids=input_ids, cache=self.cache, use_cache=True, cache_position=cache_position).logits


def main() -> None:
    from transformers import StaticCache

    from infopt.compile.passes import FuseSharedInputLinears

    model, tok = load_default()
    infopt.optimize(model, "cpu-fast")
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (1, cfg.num_key_value_heads, args.cache_length, head_dim)
    cache = StaticCache(max_cache_len=args.cache_length, config=cfg)
    cache.early_initialization(1, cfg.num_key_value_heads, head_dim, torch.float32, torch.device("cpu"))
    keys = [torch.zeros(shape) for _ in range(cfg.num_hidden_layers)]
    values = [torch.zeros(shape) for _ in range(cfg.num_hidden_layers)]

    t0 = time.perf_counter()
    with torch.no_grad():
        ep = torch.export.export(OneTokenStep(model, cache), (torch.tensor([[1]]), torch.tensor([0]), keys, values),
                                 strict=False)
    export_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    package = Path(tempfile.mkdtemp()) / "step.pt2"
    torch._inductor.aoti_compile_and_package(
        ep, package_path=str(package),
        inductor_configs={"post_grad_custom_post_pass": FuseSharedInputLinears(), "size_asserts": False})
    compile_s = time.perf_counter() - t0
    runner = torch._inductor.aoti_load_package(str(package))
    ops = sorted({str(n.target) for n in ep.graph.nodes if n.op == "call_function" and "infopt" in str(n.target)})

    ids = tok("The history of the Roman empire, told briefly:", return_tensors="pt").input_ids
    T, N = ids.shape[1], args.tokens
    if T + N > args.cache_length:
        raise SystemExit(f"--tokens {N} with a {T}-token prompt needs --cache-length >= {T + N}")

    @torch.no_grad()
    def aoti(feed=None):
        """Greedy decode (or teacher-forced along ``feed``): (tokens/s of the N steps, tokens, [N, V] logits)."""
        for t in keys + values:
            t.zero_()
        for i in range(T):  # the prompt, one token per call: the exported step takes one
            logits = runner(ids[:, i:i + 1], torch.tensor([i]), keys, values)
        toks, rows = [], []
        t0 = time.perf_counter()
        for n in range(N):
            if feed is not None:
                rows.append(logits[0, -1].clone())
            nxt = logits[0, -1].argmax() if feed is None else feed[n]
            toks.append(int(nxt))
            if n + 1 < N:
                logits = runner(nxt.view(1, 1), torch.tensor([T + n]), keys, values)
        rate = (N - 1) / (time.perf_counter() - t0)
        return rate, toks, (torch.stack(rows) if rows else None)

    @torch.no_grad()
    def fast():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False)
        prompt_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False)
        return (N - 1) / (time.perf_counter() - t0 - prompt_s), out[0, T:].tolist()

    aoti(), fast()  # warm-up
    rounds = []
    for r in range(args.rounds):
        pair = [("aoti", aoti), ("cpu-fast", fast)]
        got = dict((name, fn()) for name, fn in (pair if r % 2 == 0 else pair[::-1]))
        a, f = got["aoti"], got["cpu-fast"]
        diff = next((i for i, (x, y) in enumerate(zip(a[1], f[1], strict=True)) if x != y), None)
        rounds.append({"aoti_tok_s": round(a[0], 1), "cpu_fast_tok_s": round(f[0], 1),
                       "ratio": round(a[0] / f[0], 3), "first_token_difference": diff})
        print(rounds[-1], flush=True)

    cont = torch.tensor(fast()[1])
    path = decode_path_logits(model, ids, cont)  # cpu-fast's compiled decode step, teacher-forced
    forced = aoti(feed=cont)[2]
    m = logit_metrics(forced, path)
    result = {
        "machine": machine_info("cpu"), "tokens": N, "prompt_tokens": T, "rounds": rounds,
        "median_aoti_tok_s": statistics.median(r["aoti_tok_s"] for r in rounds),
        "median_cpu_fast_tok_s": statistics.median(r["cpu_fast_tok_s"] for r in rounds),
        "median_ratio": statistics.median(r["ratio"] for r in rounds),
        "export_s": round(export_s, 1), "aoti_compile_s": round(compile_s, 1), "infopt_ops_in_graph": ops,
        "aoti_vs_cpu_fast_decode_path": {"kl": m["kl"], "kl_max": m["kl_max"], "top1": m["top1"]},
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "rounds")}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
