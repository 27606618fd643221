"""The benchmark harness: one workload through plain transformers and through a recipe, in one process."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import time
from typing import Any

import torch
from torch import nn

from ..core.introspect import inspect_model, param_bytes
from .report import METRICS
from .workloads import WORKLOADS, Request, make_workload

__all__ = ["measure_bandwidth", "run_requests", "summarize", "run_bench", "machine_info", "weight_bytes_per_token"]



def machine_info() -> dict[str, Any]:
    """Machine, thread count and library versions, for the record."""
    import transformers

    from .._version import __version__

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "infopt": __version__,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def measure_bandwidth(size_mb: int = 256, repeats: int = 5) -> float:
    """Achievable memory bandwidth in GB/s: a large tensor copy (bytes read + bytes written) / time, median."""
    n = size_mb * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault pages in
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        dt = time.perf_counter() - t0
        rates.append(2 * src.numel() * 4 / dt / 1e9)
    return statistics.median(rates)


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of weights a decode step reads: all parameters and buffers except an untied input embedding
    (an embedding lookup reads one row; a tied one is read whole as the output head)."""
    total = param_bytes(model)
    info = inspect_model(model)
    if not info.tied_embeddings:
        emb = model.get_submodule(info.embed_fqn).weight
        total -= emb.numel() * emb.element_size()
    return total


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _FirstToken:
    """A generate streamer that timestamps the first generated token (the first ``put`` is the prompt)."""

    def __init__(self):
        self.calls = 0
        self.t_first: float | None = None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.t_first is None:
            self.t_first = time.perf_counter()

    def end(self):
        pass


@torch.inference_mode()
def run_requests(model: nn.Module, requests: list[Request], *, mode: str = "sequential", batch_size: int = 8,
                 pad_token_id: int = 0, progress: bool = False, desc: str = "") -> dict[str, Any]:
    """Serve every request with ``model.generate`` (greedy, fixed output length), timing each.

    Args:
        mode: ``sequential`` (one request at a time) or ``padded`` (naive static batching: left-padded
            batches of ``batch_size`` in arrival order, each batch runs until its longest request ends).

    Returns:
        ``{"wall": s, "requests": [{"ttft": s, "total": s, "n_out": n, "tokens": [...]}, ...]}``; all requests
        arrive at time 0, so ``ttft`` includes queueing.
    """
    from tqdm.auto import tqdm

    if mode not in ("sequential", "padded"):
        raise ValueError(f"mode={mode!r}; allowed: sequential, padded")
    device = next(model.parameters()).device
    out: list[dict[str, Any] | None] = [None] * len(requests)
    size = 1 if mode == "sequential" else batch_size
    groups = [list(range(i, min(i + size, len(requests)))) for i in range(0, len(requests), size)]
    t_start = time.perf_counter()
    for group in tqdm(groups, desc=desc, disable=not progress, leave=False):
        reqs = [requests[i] for i in group]
        longest = max(r.prompt_len for r in reqs)
        ids = torch.full((len(reqs), longest), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), longest), dtype=torch.long)
        for j, r in enumerate(reqs):  # left padding: [pad..., prompt]
            ids[j, longest - r.prompt_len:] = r.input_ids[0]
            mask[j, longest - r.prompt_len:] = 1
        new = max(r.max_new_tokens for r in reqs)
        timer = _FirstToken()
        t0 = time.perf_counter()
        gen = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=pad_token_id, streamer=timer)
        t1 = time.perf_counter()
        first = timer.t_first or t1
        for j, (i, r) in enumerate(zip(group, reqs, strict=True)):
            out[i] = {
                "ttft": first - t_start,
                "total": t1 - t_start,
                "service": t1 - t0,
                "first_service": first - t0,
                "n_out": r.max_new_tokens,
                "tokens": gen[j, longest:longest + r.max_new_tokens].tolist(),
            }
    return {"wall": time.perf_counter() - t_start, "requests": out}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(run: dict[str, Any]) -> dict[str, float]:
    """Aggregate metrics of one :func:`run_requests` result."""
    reqs = run["requests"]
    n_out = sum(r["n_out"] for r in reqs)
    decode = [(r["n_out"] - 1) / (r["service"] - r["first_service"]) for r in reqs
              if r["n_out"] > 1 and r["service"] > r["first_service"]]
    tpot = [(r["service"] - r["first_service"]) / (r["n_out"] - 1) for r in reqs if r["n_out"] > 1]
    # own TTFT: from the request's own start (no queueing) to its first token; the prefix workload
    # compares the first request (cold cache) with the later ones (shared prefix)
    own = [r["first_service"] for r in reqs]
    return {
        "tokens_per_s": n_out / run["wall"],
        "decode_tokens_per_s": statistics.median(decode) if decode else float("nan"),
        "requests_per_s": len(reqs) / run["wall"],
        "ttft_p50_ms": 1e3 * _pct([r["ttft"] for r in reqs], 0.5),
        "ttft_p90_ms": 1e3 * _pct([r["ttft"] for r in reqs], 0.9),
        "tpot_p50_ms": 1e3 * _pct(tpot, 0.5) if tpot else float("nan"),
        "prefill_first_ms": 1e3 * own[0],
        "prefill_rest_p50_ms": 1e3 * _pct(own[1:], 0.5) if len(own) > 1 else float("nan"),
        "wall_s": run["wall"],
        "output_tokens": float(n_out),
    }


def _median_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def _timed(model, requests, mode, pad, progress, desc):
    _reset_peak_rss()
    run = run_requests(model, requests, mode=mode, pad_token_id=pad, progress=progress, desc=desc)
    m = summarize(run)
    m["peak_rss_mb"] = (_peak_rss_bytes() or 0) / 2**20
    m["model_mb"] = param_bytes(model) / 2**20
    m["weight_gbs"] = weight_bytes_per_token(model) * m["decode_tokens_per_s"] / 1e9
    return m, [r["tokens"] for r in run["requests"]]


def run_bench(model: nn.Module, tokenizer, recipe: Any, workload: str, *, repeats: int = 3, seed: int = 0,
              num_requests: int | None = None, progress: bool = True, quality: bool = True,
              model_name: str = "model") -> dict[str, Any]:
    """Run ``workload`` through the plain model and through ``recipe``, interleaved, in this process.

    Each repeat runs the baseline, applies the recipe, runs the optimized model, and undoes the
    recipe, so slow drifts of the machine hit both sides alike. Medians over repeats are reported.
    A warm-up generate precedes every timed run.

    Args:
        model, tokenizer: the unoptimized model and its tokenizer (the model is left unoptimized).
        recipe: anything :func:`infopt.optimize` accepts, or None / ``"none"`` for the baseline only.
        workload: one of :data:`~infopt.bench.workloads.WORKLOADS`.
        repeats: timed repeats per side.

    Returns:
        The result dict (see docs/bench.md): machine, model, workload, recipe, baseline, optimized, ratios,
        quality, exact_greedy.
    """
    from ..optimize import optimize, undo
    from ..recipe import Recipe

    if workload not in WORKLOADS:
        raise ValueError(f"workload={workload!r}; allowed: {', '.join(WORKLOADS)}")
    if repeats < 1:
        raise ValueError(f"repeats={repeats}; must be >= 1")
    r = None if recipe in (None, "none") else Recipe.parse(recipe)
    requests = make_workload(workload, tokenizer, seed=seed, num_requests=num_requests)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    machine = machine_info()
    machine["bandwidth_gbs"] = measure_bandwidth()

    base_modes = ["sequential", "padded"] if workload == "batch" else ["sequential"]
    opt_mode = "padded" if workload == "batch" else "sequential"
    warm = requests[0].input_ids[:, :16]

    reference = None
    if r is not None and quality:
        from ..eval import reference_logits

        reference = reference_logits(model, tokenizer=tokenizer, max_tokens=512)

    base_rows: dict[str, list] = {m: [] for m in base_modes}
    opt_rows: list = []
    base_tokens: dict[str, list] = {}
    opt_tokens = None
    quality_figs = None
    for rep in range(repeats):
        model.generate(warm, max_new_tokens=4, do_sample=False, pad_token_id=pad)
        for mode in base_modes:
            m, toks = _timed(model, requests, mode, pad, progress, f"baseline {mode} {rep + 1}/{repeats}")
            base_rows[mode].append(m)
            base_tokens[mode] = toks
        if r is None:
            continue
        optimize(model, r)
        try:
            model.generate(warm, max_new_tokens=4, do_sample=False, pad_token_id=pad)
            m, opt_tokens = _timed(model, requests, opt_mode, pad, progress, f"optimized {rep + 1}/{repeats}")
            opt_rows.append(m)
            if reference is not None and quality_figs is None:
                from ..eval import compare

                quality_figs = compare(model, reference)
        finally:
            undo(model)

    baseline = {mode: _median_metrics(rows) for mode, rows in base_rows.items()}
    main_base = baseline[opt_mode]
    optimized = _median_metrics(opt_rows) if opt_rows else None
    ratios = None
    if optimized is not None:
        ratios = {k: (optimized[k] / main_base[k] if main_base[k] else float("nan")) for k in optimized}
    exact = None
    if opt_tokens is not None:
        exact = opt_tokens == base_tokens[opt_mode]
    return {
        "machine": machine,
        "model": model_name,
        "workload": {"name": workload, "description": WORKLOADS[workload], "requests": len(requests),
                     "prompt_tokens": sum(q.prompt_len for q in requests),
                     "output_tokens": sum(q.max_new_tokens for q in requests), "seed": seed, "repeats": repeats,
                     "dtype": str(next(model.parameters()).dtype), "batch_mode": opt_mode},
        "recipe": r.to_dict() if r is not None else None,
        "lossless_claimed": bool(r is not None and all(s.lossless for s in r.steps)),
        "baseline": main_base,
        "baseline_modes": baseline,
        "optimized": optimized,
        "ratios": ratios,
        "quality": quality_figs,
        "exact_greedy": exact,
        "higher_is_better": sorted(k for k, (_, higher) in METRICS.items() if higher),
    }
