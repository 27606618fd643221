"""Reading benchmark results: the stdout table, two-run comparison, the PNG chart, the history CSV."""

from __future__ import annotations

import csv
import json
import math
from html import escape
from pathlib import Path
from typing import Any

from ..core.availability import lazy_import

__all__ = ["BenchResult", "format_table", "compare_runs", "plot", "append_csv", "METRICS"]

# metric -> (label, higher is better)
METRICS: dict[str, tuple[str, bool]] = {
    "decode_tokens_per_s": ("decode tokens/s", True),
    "tokens_per_s": ("output tokens/s", True),
    "prompt_tokens_per_s": ("prompt tokens/s", True),
    "requests_per_s": ("requests/s", True),
    "ttft_p50_ms": ("TTFT p50 ms", False),
    "ttft_p90_ms": ("TTFT p90 ms", False),
    "prefill_first_ms": ("own TTFT, 1st request ms", False),
    "prefill_rest_p50_ms": ("own TTFT, later p50 ms", False),
    "tpot_p50_ms": ("time/output token p50 ms", False),
    "model_mb": ("weights+buffers MiB", False),
    "peak_rss_mb": ("peak RSS MiB", False),
    "peak_gpu_mb": ("peak GPU memory MiB", False),
    "weight_gbs": ("weight bandwidth GB/s", True),
    "kv_util_mean": ("engine KV blocks in use, mean", True),
}


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def _machine_line(mach: dict[str, Any]) -> str:
    versions = f"torch {mach['torch']}, transformers {mach['transformers']}"
    if mach.get("gpu"):  # a CUDA run: the GPU is the machine; the copy was device-to-device
        driver = f", driver {mach['nvidia_driver']}" if mach.get("nvidia_driver") else ""
        return (f"machine: {mach['gpu']} ({mach.get('gpu_memory_gib')} GiB, CUDA {mach.get('cuda_runtime')}{driver}), "
                f"host {mach['cpu']}, {versions}; measured device-to-device copy bandwidth "
                f"{mach['bandwidth_gbs']:.1f} GB/s")
    return (f"machine: {mach['cpu']}, {mach['threads']} threads, {versions}; measured copy bandwidth "
            f"{mach['bandwidth_gbs']:.1f} GB/s")


def format_table(result: dict[str, Any]) -> str:
    """A readable table of one :func:`~infopt.bench.harness.run_bench` result."""
    cols, rows = _metric_rows(result)
    w = max(len(v[0]) for v in METRICS.values())
    lines = _head_lines(result) + [""]
    lines.append(f"{'':<{w}}  " + "  ".join(f"{c:>13}" for c in cols))
    lines += [f"{label:<{w}}  " + "  ".join(f"{c:>13}" for c in cells) for label, cells in rows]
    foot = _foot_lines(result)
    if foot and foot[0].startswith("weight bandwidth achieved"):
        foot[0] = "\n" + foot[0]
    return "\n".join(lines + foot)


def _head_lines(result: dict[str, Any]) -> list[str]:
    """Workload, machine and recipe: the lines above the table."""
    wl = result["workload"]
    return [
        f"workload {wl['name']}: {wl['description']}",
        f"  {wl['requests']} requests, {wl['prompt_tokens']} prompt / {wl['output_tokens']} output tokens, "
        f"{wl['dtype']}, repeats {wl['repeats']} (median), seed {wl['seed']}",
        _machine_line(result["machine"]),
        f"recipe: {_recipe_str(result.get('recipe'))}",
    ]


def _metric_rows(result: dict[str, Any]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """``(columns, [(metric label, cells)])``: the table itself, cells formatted (ratios with an ``x``)."""
    modes = result["baseline_modes"]
    by_mode = result.get("ratios_by_mode") or {}
    extra = [m for m in by_mode if m != result.get("ratio_baseline")] if len(modes) > 1 else []
    cols = [f"HF {m}" for m in modes] + (["infopt"] if result["optimized"] else []) + \
        (["ratio"] if result["ratios"] else []) + [f"x {m}"[:13] for m in extra]
    rows = []
    for key, (label, _) in METRICS.items():
        if all(key not in modes[m] for m in modes):  # a figure this run does not have (GPU memory on CPU)
            continue
        row = [modes[m].get(key) for m in modes]
        if result["optimized"]:
            row.append(result["optimized"].get(key))
        if result["ratios"]:
            row.append(result["ratios"].get(key))
        row.extend(by_mode[m].get(key) for m in extra)
        cells = [_fmt(v) for v in row]
        if result["ratios"]:
            for i in range(len(cells) - len(extra) - 1, len(cells)):
                cells[i] = cells[i] + "x" if cells[i] != "-" else "-"
        rows.append((label, cells))
    return cols, rows


def _foot_lines(result: dict[str, Any]) -> list[str]:
    """Bandwidth achieved, quality, compilation and token identity: the lines below the table."""
    lines = []
    bw = result["machine"].get("bandwidth_gbs")
    if bw:
        b = result["baseline"]["weight_gbs"]
        line = f"weight bandwidth achieved: baseline {b:.2f} GB/s ({100 * b / bw:.0f}% of {bw:.1f} GB/s)"
        if result["optimized"]:
            o = result["optimized"]["weight_gbs"]
            line += (f", infopt {o:.2f} GB/s ({100 * o / bw:.0f}%)" if not math.isnan(o) else
                     "; infopt: none (speculative decoding verifies several tokens per pass over the weights)")
        lines.append(line)
    q = result.get("quality")
    if q:
        lines.append(f"quality vs original: KL {q['kl']:.4g} nats/token (max {q['kl_max']:.3g}), top-1 {q['top1']:.3f}, "
                     f"perplexity {q['ppl_ref']:.2f} -> {q['ppl']:.2f}")
        d = q.get("decode_path")
        if d and not d["tokens"]:
            lines.append("decode path: not measured (the recipe hands even its prompt and one token to transformers' generate)")
        elif d:
            lines.append(f"decode path vs original's ({d['tokens']} greedy tokens, one step each): KL {d['kl']:.4g} "
                         f"(max {d['kl_max']:.3g}), top-1 {d['top1']:.3f}")
    c = result.get("compile")
    if c:
        cold = c.get("cold_eager_calls_in_timed_run")
        lines.append(f"compiled decode: {c['compiles']} graph(s) in {c['seconds']:.1f} s (last repeat), "
                     f"{c.get('compiles_in_timed_run', '?')} compiled during the timed runs"
                     + (f", {cold} decode steps run eagerly on shapes the warm-up did not compile "
                        f"({', '.join(c.get('cold_shapes', []))})" if cold else ""))
        if c.get("compiles_in_timed_run"):
            lines.append("NOT VALID: the timed runs waited for a compiler, so their figures time the compile; warm "
                         "up the shapes the workload uses (Compile(warmup_batch_sizes=..., warmup_lengths=...))")
    if result.get("exact_greedy") is not None:
        claim = " (recipe claims lossless)" if result.get("lossless_claimed") else ""
        dtype = str(result.get("workload", {}).get("dtype", "")).replace("torch.", "")
        if result.get("lossless_claimed") and not result["exact_greedy"] and dtype in ("bfloat16", "float16"):
            # lossless means the same arithmetic up to the order of sums; in 16-bit floats a batched or fused kernel
            # rounds differently from a single-row one, and a greedy token near a tie flips
            claim = (f" (recipe claims lossless: in {dtype}, kernels that batch or fuse differently round differently "
                     "and flip near-tied tokens; compare in float32: --dtype float32)")
        lines.append(f"greedy outputs identical to baseline: {'yes' if result['exact_greedy'] else 'no'}{claim}")
        if result.get("divergences"):
            from .divergence import summarize_divergences

            n = result.get("workload", {}).get("requests", len(result["divergences"]))
            lines.append(summarize_divergences(result["divergences"], n, dtype or "float32"))
    return lines


class BenchResult(dict):
    """A :func:`~infopt.bench.harness.run_bench` result: the plain result dict (JSON-serialisable as it is) that
    prints as :func:`format_table` and renders as a table in a notebook.

    Example:
        >>> r = BenchResult({"machine": {}, "workload": {}})
        >>> isinstance(r, dict) and r["machine"] == {}
        True
    """

    def __str__(self) -> str:
        return format_table(self)

    def _repr_html_(self) -> str:
        cols, rows = _metric_rows(self)
        head = "".join(f"<th>{escape(c)}</th>" for c in ["", *cols])
        body = "".join("<tr><th style='text-align:left'>" + escape(label) + "</th>"
                       + "".join(f"<td style='text-align:right'>{escape(c)}</td>" for c in cells) + "</tr>"
                       for label, cells in rows)
        above = "<br>".join(escape(line.strip()) for line in _head_lines(self))
        below = "".join(f"<li>{escape(line)}</li>" for line in _foot_lines(self))
        return (f"<div><p style='text-align:left'>{above}</p><table><thead><tr>{head}</tr></thead>"
                f"<tbody>{body}</tbody></table>" + (f"<ul>{below}</ul>" if below else "") + "</div>")

    def _repr_markdown_(self) -> str:
        cols, rows = _metric_rows(self)
        lines = [line.strip() + "  " for line in _head_lines(self)] + [""]
        lines.append("| | " + " | ".join(cols) + " |")
        lines.append("|---|" + "---:|" * len(cols))
        lines += ["| " + label + " | " + " | ".join(cells) + " |" for label, cells in rows]
        foot = _foot_lines(self)
        return "\n".join(lines + ([""] + [f"- {line}" for line in foot] if foot else []))


def _recipe_str(recipe: dict | None) -> str:
    if not recipe:
        return "none (baseline only)"
    return " -> ".join(json.dumps(s, separators=(",", ":")) for s in recipe["steps"])


def compare_runs(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Ratio table of run ``b`` over run ``a`` (the optimized side if present, else the baseline)."""
    sa = a["optimized"] or a["baseline"]
    sb = b["optimized"] or b["baseline"]
    w = max(len(v[0]) for v in METRICS.values())
    lines = [f"A: {a['workload']['name']} / {_recipe_str(a.get('recipe'))} ({a['machine']['date']})",
             f"B: {b['workload']['name']} / {_recipe_str(b.get('recipe'))} ({b['machine']['date']})", "",
             f"{'':<{w}}  {'A':>12}  {'B':>12}  {'B/A':>8}"]
    for key, (label, _) in METRICS.items():
        va, vb = sa.get(key), sb.get(key)
        ratio = vb / va if va and vb is not None else None
        lines.append(f"{label:<{w}}  {_fmt(va):>12}  {_fmt(vb):>12}  {_fmt(ratio) + 'x' if ratio else '-':>8}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str | Path) -> Path:
    """Bar chart, one panel per metric, baseline vs infopt. Needs matplotlib (``infopt[bench]``).

    Drawn on a bare :class:`matplotlib.figure.Figure`, not through pyplot, so it needs no display and leaves the
    caller's backend alone (a notebook's inline charts keep working); show the PNG with
    ``IPython.display.Image(filename=path)``.
    """
    lazy_import("matplotlib", feature="benchmark charts (--plot)")
    from matplotlib.figure import Figure

    keys = [k for k in METRICS if result["baseline"].get(k) is not None and not math.isnan(result["baseline"][k])]
    fig = Figure(figsize=(2.2 * len(keys), 3.2))
    axes = fig.subplots(1, len(keys), squeeze=False)[0]
    for ax, k in zip(axes, keys, strict=True):
        names = [f"HF\n{m}" for m in result["baseline_modes"]]
        vals = [result["baseline_modes"][m][k] for m in result["baseline_modes"]]
        if result["optimized"]:
            names.append("infopt")
            vals.append(result["optimized"][k])
        ax.bar(names, vals, color=["#888888"] * (len(names) - (1 if result["optimized"] else 0)) +
               (["#2a7ab9"] if result["optimized"] else []))
        label, higher = METRICS[k]
        ax.set_title(f"{label}\n({'higher' if higher else 'lower'} is better)", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(f"infopt bench: {result['workload']['name']} — {result['model']}", fontsize=9)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    return out


def append_csv(result: dict[str, Any], path: str | Path) -> Path:
    """Append one row (date, machine, versions, recipe, key figures) to a history CSV.

    A row with columns the file's header lacks (a GPU run's ``device``/``gpu``, quality figures after
    rows without them) rewrites the file with the header extended, so every column stays under its name.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    m = result["machine"]
    row = {"date": m["date"], "cpu": m["cpu"], "threads": m["threads"], "torch": m["torch"],
           "transformers": m["transformers"], "infopt": m["infopt"], "bandwidth_gbs": round(m["bandwidth_gbs"], 2),
           "model": result["model"], "workload": result["workload"]["name"], "recipe": _recipe_str(result["recipe"]),
           "exact_greedy": result["exact_greedy"]}
    for side in ("baseline", "optimized"):
        for k in ("decode_tokens_per_s", "tokens_per_s", "ttft_p50_ms", "model_mb", "peak_rss_mb"):
            v = (result[side] or {}).get(k)
            row[f"{side}_{k}"] = round(v, 3) if isinstance(v, float) else v
    if result["quality"]:
        row["kl"] = round(result["quality"]["kl"], 5)
        row["top1"] = round(result["quality"]["top1"], 4)
        if (result["quality"].get("decode_path") or {}).get("tokens"):
            row["decode_path_kl"] = round(result["quality"]["decode_path"]["kl"], 5)
    if m.get("gpu"):
        row["device"] = m.get("device")
        row["gpu"] = m["gpu"]
        row["cuda_runtime"] = m.get("cuda_runtime")
        row["nvidia_driver"] = m.get("nvidia_driver")
    fields, rows = list(row), None
    if p.exists() and p.stat().st_size:
        with p.open(newline="") as f:
            reader = csv.DictReader(f)
            header = list(reader.fieldnames or [])
            if set(row) - set(header):
                rows = list(reader)
            fields = header + [k for k in row if k not in header]
    if rows is not None or not p.exists() or not p.stat().st_size:  # a new file, or a header to extend
        with p.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields, restval="")
            w.writeheader()
            w.writerows(rows or [])
            w.writerow(row)
        return p
    with p.open("a", newline="") as f:
        csv.DictWriter(f, fieldnames=fields, restval="").writerow(row)
    return p
