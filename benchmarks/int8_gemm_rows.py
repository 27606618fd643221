"""Int8 x int8 GEMMs against prepacked bf16 and fp32 over the default model's 210 decoder linears, by row count.

The shapes of SmolLM2-135M's 30 decoder layers (q, k, v, o, gate, up, down), each with its own random weight, so the
weights stream from memory as in a real step (a single layer repeated would sit in the cache). One pass calls every
linear once; the time is the median of 5 passes after 2 warm-ups. Columns:

- ``int_mm``: ``torch._int_mm`` on int8 activations (the GEMM alone, oneDNN's VNNI kernel on AVX-512);
- ``w8a8``: ``W8A8Linear`` on bf16 activations (per-token quantization + ``_int_mm`` + rescale: one C++ call where
  the kernels are built);
- ``bf16`` / ``fp32``: oneDNN's linear on weights prepacked once (what the batching engine runs).

    python benchmarks/int8_gemm_rows.py [--rows 1 16 64 256 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from _common import median_time  # this folder: the shared timing helpers

from infopt.bench.harness import machine_info
from infopt.quantize import W8A8Linear

SHAPES = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)] * 30  # (in, out)


def per_pass_ms(fn) -> float:
    return 1e3 * median_time(fn, runs=5, warmup=2)


def measure(m: int, int8_t, w8a8, bf16, fp32) -> dict[str, float]:
    """One pass over the 210 linears at ``m`` rows, per column (module docstring)."""
    x = {k: torch.randn(m, k) for k in (576, 1536)}
    xb = {k: v.bfloat16() for k, v in x.items()}
    xq = {k: torch.randint(-127, 128, (m, k), dtype=torch.int8) for k in x}
    ins = [k for k, _ in SHAPES]

    def packed(inputs, weights):
        return lambda: [torch.ops.mkldnn._linear_pointwise(inputs[k], p, None, "none", [], "")
                        for k, p in zip(ins, weights, strict=True)]

    return {"int_mm_ms": per_pass_ms(lambda: [torch._int_mm(xq[k], w) for k, w in zip(ins, int8_t, strict=True)]),
            "w8a8_ms": per_pass_ms(lambda: [q(xb[k]) for k, q in zip(ins, w8a8, strict=True)]),
            "bf16_ms": per_pass_ms(packed(xb, bf16)),
            "fp32_ms": per_pass_ms(packed(x, fp32))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 512])
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    weights = [torch.randn(n, k) / k ** 0.5 for k, n in SHAPES]
    w8a8 = [W8A8Linear.from_weight(w.bfloat16()) for w in weights]
    int8_t = [q.weight_int8.t() for q in w8a8]
    bf16 = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 64) for w in weights]
    fp32 = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
    rows = []
    with torch.inference_mode():
        for m in args.rows:
            row = {"rows": m, **measure(m, int8_t, w8a8, bf16, fp32)}
            rows.append(row)
            print("  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(torch.device("cpu")), "threads": torch.get_num_threads(), "rows": rows},
                      f, indent=2)


if __name__ == "__main__":
    main()
