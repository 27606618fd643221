"""Where the compiled engine's time goes on the ``throughput`` workload (64 requests, 16,002 prompt / 9,094 output
tokens, EOS ignored), from torch's profiler: the self time of the oneDNN linears, of the paged attention kernel, of
Inductor's fused kernels and of the rest, per dtype, and what rate the linears run at (their FLOPs over their time,
beside a plain ``F.linear`` of a 512-row step's shapes measured in the same process).

The engine is warmed (compiled, one untimed pass of the workload) before the profiled pass; the profiler adds a few
percent to the wall time.

    python benchmarks/studies/engine_compiled_profile.py [--dtypes float32 bfloat16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config as inductor_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the throughput benchmark's loader
from _common import median_time  # noqa: E402
from engine_throughput import load_quantized  # noqa: E402

from infopt.batching import Engine, SamplingParams  # noqa: E402
from infopt.bench.workloads import make_workload  # noqa: E402
from infopt.kvcache import Paged  # noqa: E402


def category(name: str) -> str:
    if name.startswith("mkldnn::_linear_pointwise") or name.startswith("infopt::packed_linear"):
        return "linears"
    if name.startswith("infopt::paged_attention"):
        return "attention"
    if "cpp_fused" in name:
        return "inductor_kernels"
    return "other"


def gemm_gflops(dtype: torch.dtype, config) -> float:
    """GFLOPS of F.linear on a 512-row step's shapes of this model (the median of 10 calls per shape)."""
    h, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    flops = total = 0.0
    for n, k in ((q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)):
        a, w = torch.randn(512, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
        flops += 2 * 512 * k * n
        total += median_time(lambda a=a, w=w: torch.nn.functional.linear(a, w), runs=10)
    return flops / total / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--json")
    args = ap.parse_args()
    inductor_config.cpp.enable_kernel_profile = True  # Inductor's C++ kernels appear in the profile by name
    rows = []
    for dname in args.dtypes:
        dtype = getattr(torch, dname)
        model, tok = load_quantized(dtype, "none")
        cfg = model.config
        # FLOPs of the linears: every token through the layers' matrices, the head on the output tokens only
        # (counted before the engine fuses and packs them)
        per_token = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n
                        and "lm_head" not in n)
        head = cfg.vocab_size * cfg.hidden_size
        reqs = make_workload("throughput", tok)
        engine = Engine(model, tok, kv=Paged(prefix_caching=False), compile=True)
        params = [SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=True) for r in reqs]
        prompts = [r.input_ids[0] for r in reqs]
        engine.generate(prompts, params)  # warm: compile and every step shape once
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params)
            wall = time.perf_counter() - t0
        totals: dict[str, float] = {}
        for ev in prof.key_averages():
            c = category(ev.key)
            totals[c] = totals.get(c, 0.0) + ev.self_cpu_time_total / 1e6
        prompt_tokens = sum(r.prompt_len for r in reqs)
        out_tokens = sum(len(o.token_ids) for o in outs)
        linear_flops = 2 * per_token * (prompt_tokens + out_tokens) + 2 * head * out_tokens
        row = {"dtype": dname, "wall_s": wall, "output_tokens_per_s": out_tokens / wall,
               "self_s": totals, "share": {k: v / sum(totals.values()) for k, v in totals.items()},
               "linear_gflops": linear_flops / totals["linears"] / 1e9,
               "plain_linear_gflops_512_rows": gemm_gflops(dtype, cfg)}
        rows.append(row)
        print(f"{dname}: wall {wall:.1f} s, {row['output_tokens_per_s']:.1f} output tok/s; self time "
              + ", ".join(f"{k} {v:.1f} s ({row['share'][k]:.0%})" for k, v in sorted(totals.items()))
              + f"; linears at {row['linear_gflops']:.0f} GFLOPS (plain F.linear, 512 rows: "
              f"{row['plain_linear_gflops_512_rows']:.0f})", flush=True)
        del engine, model
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(),
                       "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
