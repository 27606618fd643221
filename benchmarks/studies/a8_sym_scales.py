"""What a scale-only int4 layout saves at decode: the int8-activation int4 kernel on Llama-3.1-8B's layer shapes
(``ffn_down`` 4096 x 14336, ``gate/up`` 14336 x 4096, ``q`` 4096 x 4096), one activation row and four, with a bf16
scale and minimum per 32 weights (the ``a8`` layout, 5 bits a weight) against fp16 scales alone (``a8_sym``, 4.5
bits: every Q4_0 file's codes), the same codes in both, alternating within one process. Each figure: median
microseconds per call, the weight bytes read per second and the ratio of the two layouts.

    python benchmarks/studies/a8_sym_scales.py [--json benchmarks/results/a8_sym_scales.json]
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--rounds", type=int, default=3, help="alternations of the two layouts per shape and row count")
    args = p.parse_args()
    if not a8.available():
        raise SystemExit("the C++ quant_linear kernel is not built here")
    torch.set_num_threads(2)
    out = []
    shapes = {"ffn_down 4096x14336": (4096, 14336), "gate/up 14336x4096": (14336, 4096), "q 4096x4096": (4096, 4096)}
    for name, (n, k) in shapes.items():
        g = torch.Generator().manual_seed(0)
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        scales = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
        layouts = {"a8 (bf16 scale + min)": a8.pack_blocked_int4(codes, scales, torch.full_like(scales, 8.0)),
                   "a8_sym (fp16 scale)": a8.pack_blocked_int4_sym(codes, scales)}
        del codes
        for m in (1, 4):
            x = torch.randn(m, k, generator=g)
            times: dict[str, list[float]] = {label: [] for label in layouts}
            for _ in range(args.rounds):
                for label, (w, sm) in layouts.items():
                    times[label].append(median_time(lambda w=w, sm=sm, x=x: torch.ops.infopt.int4_a8_linear(x, w, sm, 32),
                                                    runs=7, warmup=3, min_s=0.2))
            rows = {}
            for label, (w, sm) in layouts.items():
                t = sorted(times[label])[len(times[label]) // 2]
                rows[label] = {"shape": name, "layout": label, "rows": m, "us": t * 1e6,
                               "bytes": w.nbytes + sm.nbytes, "gb_per_s": (w.nbytes + sm.nbytes) / t / 1e9}
                out.append(rows[label])
            a, s = rows["a8 (bf16 scale + min)"], rows["a8_sym (fp16 scale)"]
            out.append({"shape": name, "rows": m, "a8_over_a8_sym_time": a["us"] / s["us"],
                        "a8_over_a8_sym_bytes": a["bytes"] / s["bytes"]})
            print(f"{name:<20} M={m}: a8 {a['us']:8.0f} us ({a['gb_per_s']:5.1f} GB/s)  a8_sym {s['us']:8.0f} us "
                  f"({s['gb_per_s']:5.1f} GB/s)  time ratio {a['us'] / s['us']:.3f}, bytes {a['bytes'] / s['bytes']:.3f}",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "isa": a8.isa(), "rows": out}, indent=1))


if __name__ == "__main__":
    main()
