"""The batching engine on a GPU at 16, 64 and 256 concurrent requests (issue 47), against transformers' continuous
batching in the same process.

Each concurrency level submits that many requests at once, each a prompt of ``--context`` random token ids and
``--new`` output tokens (end-of-sequence ignored, so the work is fixed), to: the infopt engine with its decode steps
replayed as CUDA graphs, the engine without them, and transformers' ``generate_batch`` manager (``--no-hf`` skips
it). Reported per side: output tokens/s, TTFT and TPOT percentiles, steps/s, peak GPU memory; for the engine, the
share of wall time the GPU is busy over 20 decode steps (kernel time in a profiler window / the window's wall time)
and the decode step against the roofline: the time to read the weights and the KV cache once at the measured copy
bandwidth; the serving wall per step kind (decode-only steps, steps holding prompt tokens, scheduling). Greedy tokens
of the two engine sides are compared (they may part only at near-ties).

    python benchmarks/gpu_engine.py [--model default|llama3.1-8b|...] [--concurrency 16,64,256] [--context 512]
        [--new 128] [--dtype bfloat16] [--device cuda] [--compile] [--no-hf] [--host-profile] [--json out.json]

``--device cpu --model tiny`` runs it end to end on a CPU in seconds (a check of the script, not a measurement).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import infopt
from infopt.batching import Engine, SamplingParams
from infopt.bench.harness import machine_info, measure_bandwidth, run_requests
from infopt.bench.workloads import Request
from infopt.kvcache import Paged
from infopt.models import load_default, random_model, tiny_model


def _model(name: str, dtype: torch.dtype, device: str):
    if name == "default":
        return load_default(dtype, device)[0]
    if name == "tiny":
        return tiny_model("llama", dtype=dtype, max_positions=4096).to(device)
    return random_model(name, dtype=dtype, device=device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _prompts(n: int, context: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 32000), (n, context), generator=g).tolist()


def _busy_share(engine: Engine, prompts: list[list[int]], new: int, steps: int = 20) -> dict:
    """Requests prefilled, then ``steps`` decode steps under the profiler: device kernel time / wall time."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    handles = [engine.submit(p, params) for p in prompts]
    while engine.step():  # until every request has its prompt in the cache: decode-only steps from here
        if all(s.computed >= len(s.prompt) for s in engine.core.requests()):
            break
    device = str(engine.device)
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync(device)
        wall = time.perf_counter() - t0
    kernel_us = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    while engine.step():
        pass
    for h in handles:
        h.result()
    return {"step_ms": 1e3 * wall / steps, "gpu_busy": (kernel_us / 1e6) / wall if wall else float("nan")}


def _host_profile(engine: Engine, prompts: list[list[int]], new: int, top: int = 25) -> dict:
    """The whole run once more under cProfile: the host's busiest functions, in ms per engine step (own time and
    cumulative), beside the steps' count; where an eager step's host time goes on a GPU."""
    import cProfile
    import pstats

    engine.core.reset_stats()
    prof = cProfile.Profile()
    prof.enable()
    engine.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True))
    prof.disable()
    steps = max(1, engine.metrics()["steps"])
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return {"steps": steps, "top_own_ms_per_step": [
        {"function": f"{fn.rsplit('/', 2)[-1] if '/' in fn else fn}:{line}({name})", "calls_per_step": nc / steps,
         "own_ms": 1e3 * tt / steps, "cum_ms": 1e3 * ct / steps} for (fn, line, name), (_, nc, tt, ct, _) in rows]}


def _engine_side(model, prompts, new, *, graphs, compile_, device, kv_blocks, host_profile=False) -> dict:
    engine = Engine(model, max_batch_tokens=max(512, len(prompts)), max_seqs=len(prompts),
                    kv=Paged(num_blocks=kv_blocks, block_size=16), cuda_graphs=graphs, compile=compile_)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, ignore_eos=True))  # pools, kernels, autotune
    engine.core.reset_stats()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    _sync(device)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    _sync(device)
    wall = time.perf_counter() - t0
    m = engine.metrics()
    ttft = [o.metrics.first_token - t0 for o in outs]
    tpot = [(o.metrics.finished - o.metrics.first_token) / max(1, len(o.token_ids) - 1) for o in outs]
    row = {"output_tok_s": sum(len(o.token_ids) for o in outs) / wall, "wall_s": wall,
           "ttft_p50_s": _pct(ttft, 0.5), "ttft_p90_s": _pct(ttft, 0.9), "tpot_p50_ms": 1e3 * _pct(tpot, 0.5),
           "tpot_p90_ms": 1e3 * _pct(tpot, 0.9), "steps_per_s": m["steps"] / wall,
           "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None,
           "cuda_graphs": m.get("cuda_graphs"), "tokens": [o.token_ids for o in outs]}
    # where the serving wall went, per step kind (host clock; each step reads its tokens back, so it holds the GPU
    # time too): decode-only steps, the steps holding prompt tokens, and the scheduling + layout before each forward
    other = m["steps"] - m["decode_steps"]
    row.update(decode_steps=m["decode_steps"], decode_step_ms=1e3 * m["decode_busy_s"] / max(1, m["decode_steps"]),
               prompt_steps=other, prompt_step_ms=1e3 * (m["busy_s"] - m["decode_busy_s"]) / max(1, other),
               schedule_ms=1e3 * m["schedule_s"] / max(1, m["steps"]))
    row.update(_busy_share(engine, prompts, new))
    if host_profile:
        row["host_profile"] = _host_profile(engine, prompts, new)
    engine.stop(cancel=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--concurrency", default="16,64,256")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compile", action="store_true", help="compile the engine's steps (a long warm-up on CUDA)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' continuous batching")
    ap.add_argument("--host-profile", action="store_true",
                    help="run each engine side once more under cProfile: the host's busiest functions per step")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    model = _model(args.model, dtype, args.device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    gbs = measure_bandwidth(device=args.device)
    doc = {"machine": machine_info(args.device), "model": args.model, "dtype": args.dtype, "context": args.context,
           "new": args.new, "copy_gbs": gbs, "weight_bytes": weight_bytes, "levels": []}
    for n in (int(x) for x in args.concurrency.split(",")):
        prompts = _prompts(n, args.context, int(model.get_output_embeddings().weight.shape[0]), seed=n)
        blocks = n * -(-(args.context + args.new) // 16) + 64
        level = {"concurrency": n}
        for name, graphs in (("engine, CUDA graphs", args.device.startswith("cuda") or "replay"),
                             ("engine, no graphs", False)):
            level[name] = _engine_side(model, prompts, args.new, graphs=graphs, compile_=args.compile,
                                       device=args.device, kv_blocks=blocks, host_profile=args.host_profile)
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
        infopt.undo(model)  # the engines' paged attention backend off: transformers' manager picks its own
        if not args.no_hf:
            reqs = [Request(torch.tensor([p]), args.new) for p in prompts]
            run = run_requests(model, reqs, mode="hf_continuous")
            ttft = [r["ttft"] for r in run["requests"]]
            level["transformers CB"] = {"output_tok_s": sum(r["n_out"] for r in run["requests"]) / run["wall"],
                                        "wall_s": run["wall"], "ttft_p50_s": _pct(ttft, 0.5)}
        a, b = level["engine, CUDA graphs"].pop("tokens"), level["engine, no graphs"].pop("tokens")
        level["greedy_same_rows"] = sum(x == y for x, y in zip(a, b, strict=True))
        ctx = args.context + args.new // 2  # the mean context over the decode
        roof_ms = 1e3 * (weight_bytes + n * ctx * kv_per_token) / (gbs * 1e9)
        level["roofline_step_ms"] = roof_ms
        for name in ("engine, CUDA graphs", "engine, no graphs"):
            level[name]["vs_roofline"] = level[name]["step_ms"] / roof_ms
        if "transformers CB" in level:
            level["graphs_vs_hf"] = level["engine, CUDA graphs"]["output_tok_s"] / level["transformers CB"]["output_tok_s"]
        doc["levels"].append(level)
        print(json.dumps(level, default=float), flush=True)
        if args.json:  # after every level, so a run stopped by a time limit keeps the levels it finished
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1, default=float)


if __name__ == "__main__":
    main()
