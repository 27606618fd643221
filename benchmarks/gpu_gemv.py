"""Weight-only matrix-vector products on one CUDA GPU, one to a few rows: infopt's Triton GEMV kernels
(:mod:`infopt.ops.triton_gemv`) against cuBLAS bf16, torch's int4 kernel (tinygemm), infopt's int8 ``tl.dot``
kernel and ``torch._scaled_mm`` (fp8 weights and activations), and, where the package ``gemlite`` is installed, its
weight-only kernels (int4 grouped on the same codes, int8 and fp8 per channel), on the layer shapes of the 0.84B and
8B Llamas of ``benchmarks/gpu_decode.py``; with ``--sweep``, the GEMV kernels' tiles too, to set
:func:`~infopt.ops.triton_gemv.gemv_tiles`. Each gemlite row also gives its SQNR against the float product of
the same quantized weight (a check that the codes reached the kernel as meant) and whether two calls on one input
give the same bits (its split-K kernels accumulate with atomics).

Usage:
    python benchmarks/gpu_gemv.py --json gemv.json              # every kernel, rows 1 2 4 8
    python benchmarks/gpu_gemv.py --sweep --rows 1 --json s.json # and each tile configuration at one row

Each time is the median of 5 replays of a CUDA graph that runs the product once over each of as many copies of
the weight as make at least 256 MiB (so the weights come from memory, not from the 50 MB L2 of an H100/H200),
divided by the copies: launch overhead is a graph's, as in a compiled decode step. ``gbs`` is the weight bytes
(scales included) read per microsecond, ``of_copy`` that against a device-to-device copy measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics

import torch
import torch.nn.functional as F

SHAPES = {  # (name, out_features N, in_features K): q/k/v and gate/up fused, as gpu-fast runs them
    "llama-1b": [("qkv", 2560, 2048), ("o", 2048, 2048), ("gate_up", 11264, 2048), ("down", 2048, 5632)],
    "llama-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
                 ("head", 128256, 4096)],
}
MIN_BYTES = 256 << 20


def time_us(fns) -> float:
    """Median microseconds per call of the callables ``fns`` (one per weight copy), replayed from one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream (Triton compiles here)
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(fns))
    return statistics.median(times)


def copies_for(nbytes: int) -> int:
    return max(1, -(-MIN_BYTES // nbytes))


def weights(n: int, k: int, gs: int, device: str = "cuda", formats: set | None = None):
    """One layer's weight in every format (or those of ``formats``, bf16 always): bf16, int8 + scale, fp8 + scale,
    int4 packed + (scale, offset), tinygemm, gemlite's."""
    want = (lambda f: True) if formats is None else (lambda f: f in formats)
    from infopt.quantize.formats.int4 import Int4Linear, quantize_int4_grouped
    from infopt.quantize.formats.int8 import quantize_int8_per_channel
    from infopt.quantize.formats.primitives import pack_int4

    w = torch.randn(n, k, device=device) * 0.02
    out = {"bf16": (w.to(torch.bfloat16),)}
    if want("int8"):
        out["int8"] = quantize_int8_per_channel(w)
    if want("fp8") and (device == "cpu" or torch.cuda.get_device_capability() >= (8, 9)):
        s8 = w.abs().amax(1).clamp_min(1e-12) / 448
        out["fp8"] = ((w / s8[:, None]).to(torch.float8_e4m3fn), s8)
    codes, scales, zeros = quantize_int4_grouped(w, gs, zero_point="float")
    s16 = scales.to(torch.bfloat16).float()
    z16 = zeros.to(torch.bfloat16).float()
    out["_int4_ref"] = ((codes.float().view(n, -1, gs) - z16[..., None]) * s16[..., None]).view(n, k)
    out["int4"] = (pack_int4(codes), torch.stack([s16, (8.0 - zeros) * s16], -1).to(torch.bfloat16).contiguous())
    if want("tinygemm"):
        layer = Int4Linear.from_codes(codes, scales, zeros, group_size=gs, dtype=torch.bfloat16)
        if layer.layout == "cuda_tinygemm":
            out["tinygemm"] = (layer.weight_packed, layer.scale_offset)
    if gemlite_available() and device == "cuda" and any(want(f) for f in ("gemlite_int4", "gemlite_int8",
                                                                            "gemlite_fp8")):
        from gemlite.helper import A16W8_FP8, A16W8_INT8

        if want("gemlite_int4"):
            out["gemlite_int4"] = (gemlite_int4_layer(codes, scales, zeros),)
        if want("gemlite_int8"):
            out["gemlite_int8"] = (A16W8_INT8(device=device, dtype=torch.bfloat16).from_weights(
                w.to(torch.bfloat16)),)
        if want("gemlite_fp8") and torch.cuda.get_device_capability() >= (8, 9):
            out["gemlite_fp8"] = (A16W8_FP8(device=device, dtype=torch.bfloat16).from_weights(w.to(torch.bfloat16)),)
    return out


@functools.cache
def gemlite_available() -> bool:
    """Whether ``gemlite`` imports here (it needs a CUDA device); on an sm_90 part it has no tuned configs for (an
    H200), its H100 configs are loaded so that no call autotunes."""
    try:
        import gemlite
    except Exception:
        return False
    import os

    name = torch.cuda.get_device_properties(0).name.lower()
    h100 = os.path.join(os.path.dirname(gemlite.__file__), "configs", "h100.json")
    if "h100" not in name and torch.cuda.get_device_capability() == (9, 0) and os.path.exists(h100):
        gemlite.load_config(h100)
    return True


def gemlite_int4_layer(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor):
    """A gemlite bf16 x int4 layer on infopt's codes: gemlite's grouped format is HQQ's, ``(code - zero) * scale``,
    infopt's portable layout as it is."""
    from gemlite.helper import A16W4_HQQ_INT

    return A16W4_HQQ_INT(device="cuda", dtype=torch.bfloat16).from_weights(
        codes.to(torch.uint8), scales.to(torch.bfloat16), zeros.to(torch.bfloat16))


def nbytes(ts) -> int:
    """Bytes of a format's tensors, or of a module's parameters and buffers (gemlite's layers)."""
    total = 0
    for t in ts:
        if isinstance(t, torch.nn.Module):
            total += sum(b.numel() * b.element_size() for b in itertools.chain(t.parameters(), t.buffers()))
        else:
            total += t.numel() * t.element_size()
    return total


def reference_weight(fmt: str, ws: dict) -> torch.Tensor | None:
    """The float weight a gemlite format's product (and infopt's int4 GEMV's) is compared with, for its SQNR: the int4
    codes' own values (so the figure is the kernel's rounding alone), the unquantized weight for int8 and fp8 (their
    rounding included)."""
    if fmt in ("gemlite_int4", "int4"):
        return ws["_int4_ref"]
    if fmt in ("gemlite_int8", "gemlite_fp8"):
        return ws["bf16"][0].float()
    return None


def kernels(gs: int, tiles8=None, tiles4=None):
    """``{name: (format, fn(x, *weights))}``: the products measured."""
    from infopt.ops import triton_gemv as tg
    from infopt.ops.triton_int8 import int8_weight_mm

    def scaled_mm(x, w8, s8):  # what FP8Linear runs: per-row dynamic fp8 activations, row-wise scales
        xs = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448
        xq = (x.float() / xs).to(torch.float8_e4m3fn)
        return torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=s8[None, :].float(), out_dtype=torch.bfloat16)

    return {
        "cublas_bf16": ("bf16", lambda x, w: F.linear(x, w)),
        "tinygemm_int4": ("tinygemm", lambda x, p, so: torch._weight_int4pack_mm(x, p, gs, so)),
        "int8_tl_dot": ("int8", lambda x, q, s: int8_weight_mm(x, q, s)),
        "scaled_mm_fp8": ("fp8", scaled_mm),
        "gemv_int8": ("int8", lambda x, q, s: tg.launch_w8(x, q, s, tiles8)),
        "gemv_fp8": ("fp8", lambda x, q, s: tg.launch_w8(x, q, s, tiles8)),
        "gemv_int4": ("int4", lambda x, q, so: tg.launch_w4(x, q, so, gs, tiles4)),
        "gemlite_int4": ("gemlite_int4", lambda x, layer: layer(x)),
        "gemlite_int8": ("gemlite_int8", lambda x, layer: layer(x)),
        "gemlite_fp8": ("gemlite_fp8", lambda x, layer: layer(x)),
    }


def sqnr_db(y: torch.Tensor, ref: torch.Tensor) -> float:
    return round(float(10 * torch.log10(ref.pow(2).sum() / (y.float() - ref).pow(2).sum().clamp_min(1e-30))), 1)


def weight_sets(n: int, k: int, gs: int, formats: set | None = None) -> list[dict]:
    """As many copies of the layer's weights (every format, or those of ``formats``) as the bf16 one needs to leave
    L2."""
    one = weights(n, k, gs, formats=formats)
    rest = [weights(n, k, gs, formats=formats) for _ in range(copies_for(nbytes(one["bf16"])) - 1)]
    for ws in rest:  # the float reference serves the first copy's check only
        ws.pop("_int4_ref", None)
    return [one] + rest


def measure(sets: list[dict], rows: list[int], gs: int, only=None, tiles8=None, tiles4=None) -> list[dict]:
    n, k = sets[0]["bf16"][0].shape
    out = []
    for name, (fmt, fn) in kernels(gs, tiles8, tiles4).items():
        if (only and name not in only) or fmt not in sets[0]:
            continue
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            use = sets[: copies_for(nbytes(sets[0][fmt]))]
            try:
                us = time_us([functools.partial(fn, x, *ws[fmt]) for ws in use])
            except Exception as e:  # one kernel failing must not hide the others' figures
                out.append({"kernel": name, "n": n, "k": k, "rows": m, "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            b = nbytes(sets[0][fmt])
            row = {"kernel": name, "n": n, "k": k, "rows": m, "us": round(us, 2), "gbs": round(b / us / 1e3, 1)}
            ref = reference_weight(fmt, sets[0])
            if ref is not None:  # numerics of the kernel on this layer, and whether it repeats its bits
                y1, y2 = fn(x, *sets[0][fmt]), fn(x, *sets[0][fmt])
                row["sqnr_db"] = sqnr_db(y1, x.float() @ ref.t())
                row["same_bits_twice"] = bool(torch.equal(y1, y2))
            out.append(row)
    return out


SWEEP_LAYERS = "llama-8b:o,llama-8b:gate_up"
SWEEP = {"block_n": (8, 16, 32), "block_k": (256, 512, 1024), "warps": (4, 8), "stages": (1, 3)}
"""The tiles ``--sweep`` tries per layer for ``gemv_int8`` and ``gemv_int4`` (36 each, each compiled by Triton once:
sized for a lane stage of a few minutes, not yet run)."""


SWEEP_SPLIT = {"block_n": (8, 16, 32), "split": (1, 2, 4, 8)}
"""``--sweep-kernels gemv_w8_split`` / ``gemv_w4_split``: the 8-bit kernel (fp8 weights) / the 4-bit one with K split
among 1 (the table's unsplit kernel), 2, 4 or 8 programs per output block of 8, 16 or 32 rows (12 configurations per
layer and kernel, their other tiles the table's; ``benchmarks/gpu_decode.py --gemv-tiles`` decodes on the fastest; for the
4,096-output o and down projections, where the unsplit kernels read at 35-41% (8-bit) and 17-19% (4-bit) of the copy
bandwidth in the sixth run)."""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="llama-8b,llama-1b")
    p.add_argument("--layers", default=None, help="only these layers, e.g. gate_up,down,head (default: all)")
    p.add_argument("--kernels", default=None, help="only these kernels, e.g. cublas_bf16,tinygemm_int4 (default: all)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--sweep", action="store_true", help="also the GEMV kernels' tile configurations, on --sweep-layers")
    p.add_argument("--sweep-layers", default=SWEEP_LAYERS)
    p.add_argument("--sweep-kernels", default="gemv_int8,gemv_int4",
                   help="any of gemv_int8, gemv_int4 (their tiles), gemv_w8_split, gemv_w4_split (K split)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_gemv.py needs a CUDA device")
    from infopt.bench.harness import machine_info, measure_bandwidth

    copy = measure_bandwidth(device="cuda")
    doc = {"machine": machine_info("cuda"), "device_copy_gbs": copy, "group_size": args.group_size, "rows": [],
           "sweep": []}

    def save():
        if args.json:  # after each layer: a run stopped by a time limit keeps what it measured
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)

    def record(into: list, rows: list[dict], **extra):
        for r in rows:
            r.update(extra, of_copy=round(r["gbs"] / copy, 3) if "gbs" in r else None)
            into.append(r)
            print(json.dumps(r), flush=True)

    for model in args.models.split(","):
        for layer, n, k in SHAPES[model]:
            if args.layers and layer not in args.layers.split(","):
                continue
            only = args.kernels.split(",") if args.kernels else None
            formats = {fmt for name, (fmt, _) in kernels(args.group_size).items() if only is None or name in only}
            sets = weight_sets(n, k, args.group_size, formats)
            record(doc["rows"], measure(sets, args.rows, args.group_size, only=only), model=model, layer=layer)
            del sets
            torch.cuda.empty_cache()
            save()
    if args.sweep:
        for spec in args.sweep_layers.split(","):
            model, layer = spec.split(":")
            n, k = next((n, k) for name, n, k in SHAPES[model] if name == layer)
            swept = args.sweep_kernels.split(",")
            wanted = {"int8"} if "gemv_int8" in swept else set()
            sets = weight_sets(n, k, args.group_size, wanted | ({"fp8"} if "gemv_w8_split" in swept else set()))
            if "gemv_w8_split" in swept:  # the 8-bit kernel with K split among programs, on its first tiles
                from infopt.ops.triton_gemv import gemv_tiles

                _, bk, warps, stages, _ = gemv_tiles(n, k, 8)
                for bn, split in itertools.product(SWEEP_SPLIT["block_n"], SWEEP_SPLIT["split"]):
                    for kernel in ("gemv_fp8",):  # the int8 kernel is the same code on other weights
                        record(doc["sweep"], measure(sets, args.rows, args.group_size, only=(kernel,),
                                                     tiles8=(bn, bk, warps, stages, split)),
                               model=model, layer=layer, tiles=[bn, bk, warps, stages, split])
            if "gemv_w4_split" in swept:  # the 4-bit kernel likewise
                from infopt.ops.triton_gemv import gemv_tiles

                _, bk, warps, stages, _ = gemv_tiles(n, k, 4, args.group_size)
                for bn, split in itertools.product(SWEEP_SPLIT["block_n"], SWEEP_SPLIT["split"]):
                    record(doc["sweep"], measure(sets, args.rows, args.group_size, only=("gemv_int4",),
                                                 tiles4=(bn, bk, warps, stages, split)),
                           model=model, layer=layer, tiles=[bn, bk, warps, stages, split])
            for bn, warps, stages in itertools.product(SWEEP["block_n"], SWEEP["warps"], SWEEP["stages"]):
                if not {"gemv_int8", "gemv_int4"} & set(swept):
                    break
                for bk in SWEEP["block_k"]:
                    if "gemv_int8" in swept:
                        record(doc["sweep"], measure(sets, args.rows, args.group_size, only=("gemv_int8",),
                                                     tiles8=(bn, bk, warps, stages)),
                               model=model, layer=layer, tiles=[bn, bk, warps, stages])
                    if bk >= args.group_size and "gemv_int4" in swept:
                        record(doc["sweep"], measure(sets, args.rows, args.group_size, only=("gemv_int4",),
                                                     tiles4=(bn, bk, warps, stages)),
                               model=model, layer=layer, tiles=[bn, bk, warps, stages])
            del sets
            torch.cuda.empty_cache()
            save()
    save()
    names = list(kernels(args.group_size))
    print(f"{'model':<9}{'layer':<8}{'rows':>5}" + "".join(f"{name:>15}" for name in names))
    by: dict = {}
    for r in doc["rows"]:
        by.setdefault((r["model"], r["layer"], r["rows"]), {})[r["kernel"]] = r.get("gbs", "err")
    for (model, layer, m), ks in by.items():
        print(f"{model:<9}{layer:<8}{m:>5}" + "".join(f"{ks.get(name, ''):>15}" for name in names))
    print(f"GB/s of weight bytes read (scales included); device-to-device copy {copy:.0f} GB/s")
    for spec in args.sweep_layers.split(",") if args.sweep else ():
        model, layer = spec.split(":")
        for kernel in ("gemv_int8", "gemv_int4", "gemv_fp8"):
            for m in args.rows:
                got = [r for r in doc["sweep"] if (r["model"], r["layer"], r["kernel"], r["rows"]) == (model, layer,
                                                                                                     kernel, m)
                       and "gbs" in r]
                if got:
                    best = max(got, key=lambda r: r["gbs"])
                    print(f"best {kernel} {model}:{layer} rows {m}: tiles {best['tiles']} {best['gbs']} GB/s")


if __name__ == "__main__":
    main()
