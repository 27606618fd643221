"""What a GGUF file's two-level scales cost the int8-activation kernels against the scale forms they replace, at one
activation row (decode) and four, on a Q4_K_M file's shapes at Llama-3.2-3B size, with the weights streamed from
memory (each call takes the next of enough copies to outgrow the last-level cache, as a decode step does):

- int4 codes in groups of 32 with a bf16 scale and minimum per group (``a8``, 5 bits a weight), with Q4_K's two
  levels as the file has them (``a8_k``: an fp16 ``d`` and ``dmin`` per 256, a 6-bit ``sc`` and ``m`` in a byte each
  per 32; 4.625 bits), and with fp32 scales and minimums (exact too, 6 bits);
- int8 codes with a scale per 16 inputs (Q6_K) as a blocked fp32 copy (10 bits a weight read) and as Q6_K's two
  levels (an fp16 ``d`` per 256, an int8 ``sc`` per 16: 8.56 bits).

Each figure: the median microseconds per call and the bytes read per second.

    python benchmarks/studies/a8_two_level_scales.py [--json benchmarks/results/a8_two_level_scales.json]
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

STREAM_BYTES = 160 << 20  # the copies of a shape together: several times a server CPU's last-level cache


def forms(n: int, k: int, g: torch.Generator):
    """``(label, kernel, [weight, scales] per copy, bytes a call reads)`` for each scale form of an ``[n, k]`` weight."""
    copies = max(1, STREAM_BYTES // (n * k))
    int4, int8 = [], []
    for _ in range(copies):
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        w4, _ = a8.pack_blocked_int4(codes, torch.ones(n, 1), torch.zeros(n, 1))
        sk = a8.pack_k_scales((torch.rand(n, k // 256, generator=g) / 50).half(),
                              (torch.rand(n, k // 256, generator=g) / 100).half(),
                              torch.randint(0, 64, (n, k // 32), generator=g),
                              torch.randint(0, 64, (n, k // 32), generator=g))
        f32 = a8.k_scale_min(sk)
        int4.append((w4, f32.to(torch.bfloat16), sk, f32))
        w8 = a8.pack_blocked_int8(torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g))
        k6 = a8.pack_k6_scales((torch.rand(n, k // 256, generator=g) / 100).half(),
                               torch.randint(-128, 128, (n, k // 16), generator=g))
        int8.append((w8, a8.k6_block_scales(k6), k6))
    for j, label in ((1, "int4 a8 (bf16 scale, min)"), (2, "int4 a8_k (Q4_K two levels)"), (3, "int4 fp32 scale, min")):
        yield label, torch.ops.infopt.int4_a8_linear, 32, [(c[0], c[j]) for c in int4], \
            int4[0][0].nbytes + int4[0][j].nbytes
    for j, label in ((1, "int8 fp32 scale per 16"), (2, "int8 Q6_K two levels")):
        yield label, torch.ops.infopt.int8_a8_linear, 16, [(c[0], c[j]) for c in int8], \
            int8[0][0].nbytes + int8[0][j].nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    args = p.parse_args()
    if not a8.available():
        raise SystemExit("the C++ quant_linear kernel is not built here")
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    out = []
    shapes = {"ffn_up 8192x3072": (8192, 3072), "ffn_down 3072x8192": (3072, 8192), "head 128256x3072": (128256, 3072)}
    for name, (n, k) in shapes.items():
        for label, op, group, weights, nbytes in forms(n, k, g):
            for m in (1, 4):
                x = torch.randn(m, k, generator=g)
                turn = [0]

                def call(op=op, weights=weights, x=x, group=group, turn=turn):
                    w, s = weights[turn[0] % len(weights)]
                    turn[0] += 1
                    return op(x, w, s, group)

                t = median_time(call, runs=7, warmup=len(weights), min_s=0.3)
                row = {"shape": name, "form": label, "rows": m, "us": t * 1e6, "gb_per_s": nbytes / t / 1e9,
                       "bits_per_weight": 8 * nbytes / (n * k)}
                out.append(row)
                print(f"{name:<20} {label:<30} M={m}: {row['us']:9.0f} us  {row['gb_per_s']:6.1f} GB/s  "
                      f"{row['bits_per_weight']:.3f} bits", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "isa": a8.isa(), "rows": out}, indent=1))


if __name__ == "__main__":
    main()
