"""What a scale per group costs the int8-activation kernel: one activation row (decode) and four, on a Q4_K_M file's
8-bit shapes at Llama-3.2-3B size (the tied head 128256 x 3072 and ``ffn_down`` 3072 x 8192), for int8 codes with one
scale per row, with a scale per 16 inputs (Q6_K) and per 32 (Q8_0), the same grouped codes on the int8 x fp32 kernel
(float activations: the path before group scales took int8 activations), and int4 codes in groups of 32 (the a8
int4 layout) for a rate per byte to compare. Each figure: median microseconds per call and the weight bytes read
(codes, sums and scales) per second.

    python benchmarks/studies/a8_group_scales.py [--json benchmarks/results/a8_group_scales.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import median_time  # noqa: E402

from infopt.bench.harness import machine_info  # noqa: E402
from infopt.quantize.formats import a8  # noqa: E402
from infopt.quantize.formats.int4 import quantize_int4_grouped  # noqa: E402


def cases(n: int, k: int):
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g)
    w16 = a8.pack_blocked_int8(codes)
    rows = torch.rand(n, generator=g) / 100
    yield "int8 a8, scale per row", lambda x: torch.ops.infopt.int8_a8_linear(x, w16, rows, 16), \
        w16.nbytes + rows.nbytes
    for group in (16, 32):
        scale = a8.block_scales(torch.rand(n, k // group, generator=g) / 100)
        yield f"int8 a8, scale per {group}", lambda x, s=scale: torch.ops.infopt.int8_a8_linear(x, w16, s, 16), \
            w16.nbytes + scale.nbytes
    scale = torch.rand(n, k // 16, generator=g) / 100
    yield "int8 x fp32, scale per 16", lambda x, c=codes: torch.ops.infopt.int8_f32_linear(x, c, scale), \
        codes.nbytes + scale.nbytes
    w4, sm = a8.pack_blocked_int4(*quantize_int4_grouped(torch.randn(n, k, generator=g), 32, zero_point="float"))
    yield "int4 a8, group 32", lambda x: torch.ops.infopt.int4_a8_linear(x, w4, sm, 32), w4.nbytes + sm.nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    args = p.parse_args()
    if not a8.available():
        raise SystemExit("the C++ quant_linear kernel is not built here")
    torch.set_num_threads(2)
    out = []
    for name, (n, k) in {"head 128256x3072": (128256, 3072), "ffn_down 3072x8192": (3072, 8192)}.items():
        for label, fn, nbytes in cases(n, k):
            for m in (1, 4):
                x = torch.randn(m, k)
                t = median_time(lambda fn=fn, x=x: fn(x), runs=7, warmup=3, min_s=0.2)
                row = {"shape": name, "kernel": label, "rows": m, "us": t * 1e6, "gb_per_s": nbytes / t / 1e9}
                out.append(row)
                print(f"{name:<20} {label:<28} M={m}: {row['us']:9.0f} us  {row['gb_per_s']:6.1f} GB/s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "isa": a8.isa(), "rows": out}, indent=1))


if __name__ == "__main__":
    main()
