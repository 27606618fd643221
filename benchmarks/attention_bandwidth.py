"""How fast infopt's C++ paged-attention kernel reads the KV cache, against the machine's read bandwidth in the same run.

Decode steps only (one query per sequence), at the shapes the library runs them:

- ``static``: one sequence over a static cache (the compiled ``cpu-fast`` step's layout, ``[1, kv_heads, L, d]`` per
  layer viewed as blocks), at ``--contexts`` keys;
- ``engine``: ``--seqs`` sequences of ``--engine-context`` keys each in a paged block pool (the batching engine's
  layout, 16-token blocks of ``[16, kv_heads, d]`` scattered over the pool).

For each K/V dtype (fp32, bf16, fp16) and attention shape (``--shapes``, query heads x KV heads x head size; the
defaults are Llama-3.2-3B's 24x8x128, Qwen2.5-1.5B's 12x2x128 and the default model's 9x3x64): the kernel's time per
layer (median of the repeats, several layers' caches in turn so nothing stays in the CPU's caches), the bytes of K/V it
reads, GB/s, and that as a share of the read bandwidth of a plain sum over as many bytes (``torch.sum``, same threads,
same run).

Usage: python benchmarks/attention_bandwidth.py [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from infopt.attention import paged
from infopt.attention.gqa import static_cache_attention

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--contexts", nargs="+", type=int, default=[4096, 16384])
p.add_argument("--seqs", type=int, default=64)
p.add_argument("--engine-context", type=int, default=256)
p.add_argument("--shapes", nargs="+", default=["24x8x128", "12x2x128", "9x3x64"])
p.add_argument("--repeats", type=int, default=15)
p.add_argument("--json", default=None)
args = p.parse_args()

if not paged.load_cpu_kernel():
    raise SystemExit("the C++ paged-attention kernel is not built here (infopt.ops.cpp.status())")
torch.set_num_threads(args.threads)
torch.manual_seed(0)
LAYERS_BYTES = 256 * 2**20  # at least this many K/V bytes cycled through, so each call reads from memory
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def timed(fn, n_layers: int) -> float:
    """Median seconds of one call, each repeat calling every layer once."""
    fn(0)
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for i in range(n_layers):
            fn(i)
        times.append((time.perf_counter() - t0) / n_layers)
    return statistics.median(times)


def read_bandwidth(n_bytes: int) -> float:
    """GB/s of torch.sum over ``n_bytes`` of fp32, cycled like the kernel's layers."""
    n = max(1, LAYERS_BYTES // n_bytes)
    xs = [torch.randn(n_bytes // 4) for _ in range(n)]
    return n_bytes / timed(lambda i: xs[i].sum(), n) / 1e9


def static_case(h: int, h_kv: int, d: int, length: int, dtype) -> dict:
    per_layer = 2 * h_kv * length * d * dtype.itemsize
    n = max(2, LAYERS_BYTES // per_layer)
    ks = [torch.randn(1, h_kv, length, d).to(dtype) for _ in range(n)]
    vs = [torch.randn(1, h_kv, length, d).to(dtype) for _ in range(n)]
    q = torch.randn(1, h, 1, d)
    kv_len = torch.tensor([length])
    sec = timed(lambda i: static_cache_attention(q, ks[i], vs[i], kv_len), n)
    return {"seconds": sec, "bytes": per_layer}


def engine_case(h: int, h_kv: int, d: int, seqs: int, context: int, dtype) -> dict:
    bs = 16
    per_seq = -(-context // bs)
    blocks = seqs * per_seq + 8
    per_layer = 2 * seqs * context * h_kv * d * dtype.itemsize
    n = max(2, LAYERS_BYTES // per_layer)
    g = torch.Generator().manual_seed(1)
    kp = [torch.randn(blocks, bs, h_kv, d).to(dtype) for _ in range(n)]
    vp = [torch.randn(blocks, bs, h_kv, d).to(dtype) for _ in range(n)]
    table = torch.randperm(blocks, generator=g)[:seqs * per_seq].view(seqs, per_seq).to(torch.int32)
    q = torch.randn(seqs, h, d)
    starts = torch.arange(seqs + 1)
    lens = torch.full((seqs,), context, dtype=torch.long)
    op = torch.ops.infopt.paged_attention
    sec = timed(lambda i: op(q, kp[i], vp[i], table, starts, lens, d ** -0.5, 0), n)
    return {"seconds": sec, "bytes": per_layer}


rows = []
print(f"{platform.machine()}, torch {torch.__version__}, {args.threads} threads")
for shape in args.shapes:
    h, h_kv, d = map(int, shape.split("x"))
    cases = [("static", f"1 x {n}", lambda dt, n=n, h=h, h_kv=h_kv, d=d: static_case(h, h_kv, d, n, dt))
             for n in args.contexts]
    cases.append(("engine", f"{args.seqs} x {args.engine_context}",
                  lambda dt, h=h, h_kv=h_kv, d=d: engine_case(h, h_kv, d, args.seqs, args.engine_context, dt)))
    for layout, keys, run in cases:
        for name, dtype in DTYPES.items():
            try:
                got = run(dtype)
            except RuntimeError as e:  # a kernel build that takes no such pools (an earlier version's, say)
                print(f"{shape:>9} {layout:>6} {keys:>10} {name}: refused ({str(e).splitlines()[0]})")
                continue
            ref = read_bandwidth(got["bytes"])
            gbs = got["bytes"] / got["seconds"] / 1e9
            row = {"shape": shape, "layout": layout, "sequences_x_keys": keys, "kv_dtype": name,
                   "us_per_layer": round(got["seconds"] * 1e6, 1), "kv_bytes_per_layer": got["bytes"],
                   "gb_per_s": round(gbs, 2), "sum_gb_per_s": round(ref, 2), "share_of_sum": round(gbs / ref, 3)}
            rows.append(row)
            print(f"{shape:>9} {layout:>6} {keys:>10} {name}: {row['us_per_layer']:8.1f} us/layer, {gbs:5.1f} GB/s "
                  f"({row['share_of_sum']:.0%} of a sum's {ref:.1f})", flush=True)

if args.json:
    out = {"machine": platform.machine(), "processor": platform.processor(), "torch": torch.__version__,
           "threads": args.threads, "date": time.strftime("%Y-%m-%d"), "args": vars(args), "rows": rows}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.json}")
