"""The benchmark harness: one workload through plain transformers and through a recipe, in one process."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shutil
import statistics
import subprocess
import time
from typing import Any

import torch
import transformers
from torch import nn
from tqdm.auto import tqdm
from transformers import GenerationConfig

from .._version import __version__
from ..batching import SamplingParams, batching_engine
from ..compile import compile_stats
from ..core.introspect import inspect_model, param_bytes
from ..generate import decoder_for
from ..optimize import optimize, undo
from ..recipe import Recipe
from .report import METRICS, BenchResult
from .workloads import WORKLOADS, Request, make_workload

__all__ = ["measure_bandwidth", "run_requests", "summarize", "run_bench", "machine_info", "weight_bytes_per_token"]


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a host clock read after it covers that work (CUDA runs async)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _nvidia_driver() -> str | None:
    """The NVIDIA driver version from ``nvidia-smi`` (None without it); every GPU of a machine shares one driver."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        res = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = res.stdout.strip().splitlines() if res.returncode == 0 else []
    return lines[0].strip() if lines else None


def _gpu_info(device: torch.device) -> dict[str, Any]:
    """GPU name, memory, compute capability, CUDA runtime and driver of a CUDA ``device`` (all None otherwise)."""
    if device.type != "cuda":
        return {"gpu": None, "gpu_memory_gib": None, "gpu_capability": None, "cuda_runtime": None,
                "nvidia_driver": None}
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {
        "gpu": props.name,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "gpu_capability": f"{props.major}.{props.minor}",
        "cuda_runtime": torch.version.cuda,
        "nvidia_driver": _nvidia_driver(),
    }


def machine_info(device: str | torch.device = "cpu") -> dict[str, Any]:
    """Machine, thread count and library versions, for the record.

    Args:
        device: the device the benchmark runs on; for a CUDA device the GPU's name, memory, compute
            capability, the CUDA runtime torch was built with and the NVIDIA driver are recorded too.

    Returns:
        ``{"cpu", "cores", "threads", "device", "gpu", "gpu_memory_gib", "gpu_capability", "cuda_runtime",
        "nvidia_driver", "python", "torch", "transformers", "infopt", "date"}`` (GPU fields None on CPU).

    Example:
        >>> machine_info()["device"]
        'cpu'
    """
    device = torch.device(device)
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
        "device": str(device),
        **_gpu_info(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "infopt": __version__,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _copy_seconds_cpu(src: torch.Tensor, dst: torch.Tensor) -> float:
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0


def _copy_seconds_cuda(src: torch.Tensor, dst: torch.Tensor) -> float:
    # device-to-device copy timed on the GPU's own clock: events around the copy, on the current stream
    with torch.cuda.device(src.device):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / 1e3  # ms -> s


def _copy_timer(device: torch.device):
    """How one copy is timed on ``device``: the host clock on CPU, CUDA events on a GPU."""
    if device.type == "cpu":
        return _copy_seconds_cpu
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"measure_bandwidth(device={str(device)!r}): no CUDA device is visible; use device='cpu'")
        return _copy_seconds_cuda
    raise ValueError(f"measure_bandwidth(device={str(device)!r}); allowed: cpu, cuda, cuda:N")


def measure_bandwidth(size_mb: int = 256, repeats: int = 5, *, device: str | torch.device = "cpu") -> float:
    """Achievable memory bandwidth of ``device`` in GB/s: a large tensor copy within that device's memory,
    (bytes read + bytes written) / time, median over ``repeats``.

    On CPU the copy is timed with the host clock; on CUDA it is a device-to-device copy timed with CUDA
    events (so it is the GPU's memory bandwidth, not a host copy's or a transfer's).

    Args:
        size_mb: MiB copied per repeat.
        repeats: timed copies (after one untimed copy that faults pages in / warms the kernel).
        device: ``"cpu"`` or a CUDA device.

    Returns:
        GB/s (1e9 bytes per second).

    Raises:
        ValueError: another device type, or a CUDA device on a machine without one.

    Example:
        >>> measure_bandwidth(size_mb=8, repeats=2) > 0
        True
    """
    device = torch.device(device)
    timer = _copy_timer(device)
    n = size_mb * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault pages in
    _sync(device)
    rates = [2 * src.numel() * 4 / timer(src, dst) / 1e9 for _ in range(repeats)]
    return statistics.median(rates)


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of weights a decode step reads: all parameters and buffers except an untied input embedding
    (an embedding lookup reads one row; a tied one is read whole as the output head) and the bf16 prompt
    copies of int4 layers (``dense_prefill``)."""
    total = param_bytes(model)
    for mod in model.modules():  # int4 layers' bf16 copies serve prompts only (dense_prefill)
        dense = getattr(mod, "weight_dense", None)
        if isinstance(dense, torch.Tensor):
            total -= dense.numel() * dense.element_size()
    info = inspect_model(model)
    emb = getattr(model.get_submodule(info.embed_fqn), "weight", None)  # None: it reads the head's codes
    if not info.tied_embeddings and emb is not None:
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
    """A generate streamer that timestamps the first generated token (the first ``put`` is the prompt).

    On CUDA it waits for the device before reading the clock, so the time covers the first token's kernels.
    """

    def __init__(self, device: torch.device = torch.device("cpu")):
        self.calls = 0
        self.t_first: float | None = None
        self.device = device

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.t_first is None:
            _sync(self.device)
            self.t_first = time.perf_counter()

    def end(self):
        pass


RUN_MODES = ("sequential", "padded", "hf_continuous", "engine")
BATCH_WORKLOADS = ("batch", "throughput")  # served as batches (padded / engine), not one request at a time


def _run_engine(model: nn.Module, requests: list[Request]) -> dict[str, Any]:
    """Every request submitted at time 0 to the model's batching engine (:func:`infopt.batching.enable_`)."""
    engine = batching_engine(model)
    if engine is None:
        raise ValueError("mode 'engine' needs a model with the batching step applied (recipe stage 'batching')")
    device = _model_device(model)
    before = dict(engine.stats)
    _sync(device)
    t_start = time.perf_counter()
    handles = [engine.submit(r.input_ids[0], SamplingParams(max_new_tokens=r.max_new_tokens,
                                                       min_new_tokens=r.max_new_tokens))
               for r in requests]
    outs = [h.result() for h in handles]
    _sync(device)
    wall = time.perf_counter() - t_start
    rows = []
    for o in outs:
        m = o.metrics
        rows.append({"ttft": m.first_token - t_start, "total": m.finished - t_start,
                     "service": m.finished - m.first_scheduled, "first_service": m.first_token - m.first_scheduled,
                     "n_out": len(o.token_ids), "tokens": o.token_ids})
    steps = engine.stats["steps"] - before["steps"]
    return {"wall": wall, "requests": rows,
            "kv_util_mean": (engine.stats["kv_util_sum"] - before["kv_util_sum"]) / steps if steps else float("nan")}


def _run_hf_continuous(model: nn.Module, requests: list[Request]) -> dict[str, Any]:
    """transformers' own continuous batching (``generate_batch``'s manager), every request submitted at time 0
    with its own ``max_new_tokens`` and end-of-sequence disabled, for the same fixed work as the other modes."""
    gc = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_new_tokens for r in requests), eos_token_id=-1,
                          pad_token_id=model.generation_config.pad_token_id)
    before = model.config._attn_implementation
    results: dict[str, Any] = {}
    with model.continuous_batching_context_manager(generation_config=gc, block=True, timeout=30) as manager:
        _sync(_model_device(model))
        t_start = time.perf_counter()
        ids = [manager.add_request(r.input_ids[0].tolist(), request_id=f"r{i}", max_new_tokens=r.max_new_tokens,
                                   record_timestamps=True, eos_token_id=-1) for i, r in enumerate(requests)]
        while len(results) < len(ids):
            res = manager.get_result(timeout=1)
            if res is not None and res.is_finished():
                results[res.request_id] = res
            elif res is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped before finishing the requests")
    wall = time.perf_counter() - t_start
    if model.config._attn_implementation != before:  # the manager may switch backends; leave the model as found
        model.set_attn_implementation(before)
    rows = []
    for i in range(len(requests)):
        res = results[f"r{i}"]
        ts = res.timestamps or [t_start + wall]
        rows.append({"ttft": ts[0] - t_start, "total": ts[-1] - t_start, "service": ts[-1] - t_start,
                     "first_service": ts[0] - t_start, "n_out": len(res.generated_tokens),
                     "tokens": list(res.generated_tokens)})
    return {"wall": wall, "requests": rows}


def run_requests(model: nn.Module, requests: list[Request], *, mode: str = "sequential", batch_size: int = 8,
                 pad_token_id: int = 0, progress: bool = False, desc: str = "") -> dict[str, Any]:
    """Serve every request with ``model.generate`` (greedy, fixed output length), timing each.

    Args:
        mode: ``sequential`` (one request at a time), ``padded`` (naive static batching: left-padded
            batches of ``batch_size`` in arrival order, each batch runs until its longest request ends),
            ``hf_continuous`` (transformers' continuous batching) or ``engine`` (the model's infopt
            batching engine); the last two get every request at time 0.

    Returns:
        ``{"wall": s, "prompt_tokens": n, "requests": [{"ttft": s, "total": s, "n_out": n, "tokens": [...]}, ...]}``
        (plus ``kv_util_mean``, the engine's mean fraction of KV blocks in use per step, in ``engine`` mode); all
        requests arrive at time 0, so ``ttft`` includes queueing.
    """
    if mode == "engine":
        run = _run_engine(model, requests)
    elif mode == "hf_continuous":
        run = _run_hf_continuous(model, requests)
    elif mode in ("sequential", "padded"):
        run = _run_generate(model, requests, mode, batch_size, pad_token_id, progress, desc)
    else:
        raise ValueError(f"mode={mode!r}; allowed: {', '.join(RUN_MODES)}")
    run["prompt_tokens"] = sum(r.prompt_len for r in requests)
    return run


@torch.inference_mode()
def _run_generate(model, requests, mode, batch_size, pad_token_id, progress, desc):
    device = _model_device(model)
    out: list[dict[str, Any] | None] = [None] * len(requests)
    size = 1 if mode == "sequential" else batch_size
    groups = [list(range(i, min(i + size, len(requests)))) for i in range(0, len(requests), size)]
    _sync(device)
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
        ids, mask = ids.to(device), mask.to(device)
        timer = _FirstToken(device)
        _sync(device)  # the copies above are not part of the request's time
        t0 = time.perf_counter()
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=pad_token_id, streamer=timer)
        _sync(device)
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
    _sync(device)
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
        "prompt_tokens_per_s": run.get("prompt_tokens", float("nan")) / run["wall"],
        "decode_tokens_per_s": statistics.median(decode) if decode else float("nan"),
        "requests_per_s": len(reqs) / run["wall"],
        "ttft_p50_ms": 1e3 * _pct([r["ttft"] for r in reqs], 0.5),
        "ttft_p90_ms": 1e3 * _pct([r["ttft"] for r in reqs], 0.9),
        "tpot_p50_ms": 1e3 * _pct(tpot, 0.5) if tpot else float("nan"),
        "prefill_first_ms": 1e3 * own[0],
        "prefill_rest_p50_ms": 1e3 * _pct(own[1:], 0.5) if len(own) > 1 else float("nan"),
        "wall_s": run["wall"],
        "output_tokens": float(n_out),
        "kv_util_mean": run.get("kv_util_mean", float("nan")),
    }


def _median_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def _timed(model, requests, mode, pad, progress, desc):
    device = _model_device(model)
    _reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    run = run_requests(model, requests, mode=mode, pad_token_id=pad, progress=progress, desc=desc)
    m = summarize(run)
    m["peak_rss_mb"] = (_peak_rss_bytes() or 0) / 2**20
    if device.type == "cuda":  # tensors torch allocated on the GPU (weights, caches, activations), at their peak
        m["peak_gpu_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    m["model_mb"] = param_bytes(model) / 2**20
    # bytes a decode step reads x tokens/s is a bandwidth only where each token costs one step: a speculative verify
    # serves several tokens from one pass (and a draft reads weights of its own), so there it would exceed the memory's
    m["weight_gbs"] = (weight_bytes_per_token(model) * m["decode_tokens_per_s"] / 1e9
                       if getattr(decoder_for(model), "speculative", None) is None else float("nan"))
    return m, [r["tokens"] for r in run["requests"]]


def _compile_figures(model: nn.Module) -> dict | None:
    """The compile step's counters for the optimized run (graphs, seconds, compiles after warm-up), or None."""
    stats = compile_stats(model)
    return None if stats is None else stats.as_dict()


def run_bench(model: nn.Module, tokenizer, recipe: Any, workload: str, *, repeats: int = 3, seed: int = 0,
              num_requests: int | None = None, progress: bool = True, quality: bool = True,
              model_name: str = "model", baselines: list[str] | None = None) -> dict[str, Any]:
    """Run ``workload`` through the plain model and through ``recipe``, interleaved, in this process.

    Each repeat runs the baseline, applies the recipe, runs the optimized model, and undoes the
    recipe, so slow drifts of the machine hit both sides alike. Medians over repeats are reported.
    A warm-up generate precedes every timed run. Everything runs on the model's device: on CUDA the
    clocks are read after synchronizing the device, peak GPU memory is reported beside peak RSS, and the
    machine record holds the GPU and its measured device-to-device copy bandwidth.

    Args:
        model, tokenizer: the unoptimized model and its tokenizer (the model is left unoptimized).
        recipe: anything :func:`infopt.optimize` accepts, or None / ``"none"`` for the baseline only.
        workload: one of :data:`~infopt.bench.workloads.WORKLOADS`.
        repeats: timed repeats per side.
        baselines: plain-transformers modes to run (:data:`RUN_MODES` but ``engine``); default ``sequential``,
            plus ``padded`` on the batch workload, plus transformers' own continuous batching
            (``hf_continuous``) when the recipe has a batching step (which then runs as ``engine``: every
            request submitted at once). Ratios are against ``sequential`` for batching recipes.

    Returns:
        The result dict (see docs/bench.md): machine, model, workload, recipe, baseline, optimized, ratios,
        quality, exact_greedy; a :class:`~infopt.bench.report.BenchResult`, which prints as a table.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"workload={workload!r}; allowed: {', '.join(WORKLOADS)}")
    if repeats < 1:
        raise ValueError(f"repeats={repeats}; must be >= 1")
    r = None if recipe in (None, "none") else Recipe.parse(recipe)
    requests = make_workload(workload, tokenizer, seed=seed, num_requests=num_requests)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    device = _model_device(model)
    machine = machine_info(device)
    machine["bandwidth_gbs"] = measure_bandwidth(device=device)

    batching = r is not None and any(st.stage == "batching" for st in r.steps)
    if baselines is None:
        baselines = ["sequential", "padded", "hf_continuous"] if batching else \
            (["sequential", "padded"] if workload in BATCH_WORKLOADS else ["sequential"])
    bad = [m for m in baselines if m not in RUN_MODES or m == "engine"]
    if bad or not baselines:
        raise ValueError(f"baselines={baselines!r}; allowed: {', '.join(m for m in RUN_MODES if m != 'engine')}")
    base_modes = list(baselines)
    opt_mode = "engine" if batching else ("padded" if workload in BATCH_WORKLOADS else "sequential")
    ratio_base = "sequential" if batching else opt_mode
    if ratio_base not in base_modes:
        ratio_base = base_modes[0]
    # warm-up: the first request at its own length, so lazily built state sized by the call (a static cache
    # bucket, a compiled decode graph) is built before timing, as a server's first request would build it
    warm = requests[0].input_ids.to(device)
    warm_new = requests[0].max_new_tokens

    reference = None
    if r is not None and quality:
        from ..eval import compare, decode_path_compare, decode_path_reference, reference_logits

        reference = reference_logits(model, tokenizer=tokenizer, max_tokens=512)
        path_ref = decode_path_reference(model, reference.input_ids)

    base_rows: dict[str, list] = {m: [] for m in base_modes}
    opt_rows: list = []
    base_tokens: dict[str, list] = {}
    opt_tokens = None
    quality_figs = None
    compiled = None
    timed_compiles = timed_cold = 0
    for rep in range(repeats):
        model.generate(warm, max_new_tokens=warm_new, do_sample=False, pad_token_id=pad)
        for mode in base_modes:
            m, toks = _timed(model, requests, mode, pad, progress, f"baseline {mode} {rep + 1}/{repeats}")
            base_rows[mode].append(m)
            base_tokens[mode] = toks
        if r is None:
            continue
        optimize(model, r)
        try:
            model.generate(warm, max_new_tokens=warm_new, do_sample=False, pad_token_id=pad)
            before = _compile_figures(model)
            m, opt_tokens = _timed(model, requests, opt_mode, pad, progress, f"optimized {rep + 1}/{repeats}")
            opt_rows.append(m)
            compiled = _compile_figures(model)
            if compiled is not None:  # summed over the repeats: a compile in any timed run spoils the figures
                timed_compiles += compiled["compiles"] - before["compiles"]
                timed_cold += compiled["cold_eager_calls"] - before["cold_eager_calls"]
                compiled["compiles_in_timed_run"] = timed_compiles
                compiled["cold_eager_calls_in_timed_run"] = timed_cold
            if reference is not None and quality_figs is None:
                quality_figs = compare(model, reference)
                quality_figs["decode_path"] = decode_path_compare(model, path_ref)
        finally:
            undo(model)

    baseline = {mode: _median_metrics(rows) for mode, rows in base_rows.items()}
    main_base = baseline[ratio_base]
    optimized = _median_metrics(opt_rows) if opt_rows else None
    ratios = ratios_by_mode = None
    if optimized is not None:
        ratios_by_mode = {mode: {k: (optimized[k] / b[k] if b[k] else float("nan")) for k in optimized}
                          for mode, b in baseline.items()}
        ratios = ratios_by_mode[ratio_base]
    exact, parted = None, None
    if opt_tokens is not None:
        exact = opt_tokens == base_tokens[ratio_base]
        if not exact:  # the model is unoptimized again: it is the reference for the margins
            from .divergence import divergences

            parted = divergences(model, [q.input_ids for q in requests], base_tokens[ratio_base], opt_tokens)
    return BenchResult({  # a dict that renders as a table in notebooks
        "machine": machine,
        "model": model_name,
        "workload": {"name": workload, "description": WORKLOADS[workload], "requests": len(requests),
                     "prompt_tokens": sum(q.prompt_len for q in requests),
                     "output_tokens": sum(q.max_new_tokens for q in requests), "seed": seed, "repeats": repeats,
                     "dtype": str(next(model.parameters()).dtype), "batch_mode": opt_mode},
        "recipe": r.to_dict() if r is not None else None,
        "lossless_claimed": bool(r is not None and all(s.lossless for s in r.steps)),
        "fidelity": None if r is None else max((s.fidelity for s in r.steps),
                                               key=("exact", "lossless", "lossy").index),
        "baseline": main_base,
        "baseline_modes": baseline,
        "optimized": optimized,
        "ratios": ratios,
        "ratio_baseline": ratio_base,
        "ratios_by_mode": ratios_by_mode,
        "quality": quality_figs,
        "compile": compiled,
        # a figure that includes a compile is a compile's time, not the recipe's speed: such a run is not valid
        "valid": not (compiled or {}).get("compiles_in_timed_run"),
        "exact_greedy": exact,
        "divergences": parted,
        "higher_is_better": sorted(k for k, (_, higher) in METRICS.items() if higher),
    })
