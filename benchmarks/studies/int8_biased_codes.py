"""The int8-weight x int8-activation kernel before and after its codes were stored plus 128 (no per-weight sums).

Times ``torch.ops.infopt.int8_a8_linear`` at 1 and 4 rows on three weights: the default model's head (49152 x 576,
one scale per row), a Q6_K-like layer (8960 x 1536, a scale per 16 inputs) and a Qwen3 head (151936 x 2048, a scale
per 16), activation groups of 16. The layout before (commit dbcd4e2) kept each row's sum of codes per activation group
beside the codes (int32 per 16 weights: 2 bits a weight more, read every call); the layout after stores the codes
biased, the integer product's unsigned operand, and undoes the offset with the activations' own sums. The script
detects which layout the imported infopt has, so one run per tree, alternating::

    git worktree add /tmp/before dbcd4e2
    for i in 1 2 3; do
        PYTHONPATH=/tmp/before/src python benchmarks/studies/int8_biased_codes.py
        python benchmarks/studies/int8_biased_codes.py
    done

Result (2026-11-30, 2-core AMD EPYC with AVX512-VNNI): ``benchmarks/results/int8_biased_codes.json``.
"""

import inspect
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import median_time  # noqa: E402

from infopt.quantize.formats import a8  # noqa: E402

SHAPES = {"head 49152x576 per-row": (49152, 576, 0), "q6k-like 8960x1536 /16": (8960, 1536, 16),
          "qwen3 head 151936x2048 /16": (151936, 2048, 16)}


def main() -> None:
    if not a8.available():
        raise SystemExit("the C++ kernels are not built here")
    torch.manual_seed(0)
    biased = len(inspect.signature(a8.pack_blocked_int8).parameters) == 1
    out = {"layout": "biased codes" if biased else "codes + sums", "us": {}}
    for name, (n, k, gw) in SHAPES.items():
        codes = torch.randint(-32, 32, (n, k), dtype=torch.int8)
        scale = torch.rand(n) * 0.01 if not gw else a8.block_scales(torch.rand(n, k // gw) * 0.01)
        packed = a8.pack_blocked_int8(codes) if biased else a8.pack_blocked_int8(codes, 16)
        for m in (1, 4):
            x = torch.randn(m, k)
            if biased:
                def f(x=x, packed=packed, scale=scale):
                    return torch.ops.infopt.int8_a8_linear(x, packed, scale, 16)
            else:
                def f(x=x, packed=packed, scale=scale):
                    return torch.ops.infopt.int8_a8_linear(x, packed[0], packed[1], scale, 16)
            out["us"][f"{name} rows {m}"] = median_time(f, runs=7, min_s=0.2) * 1e6
    print(json.dumps(out))


if __name__ == "__main__":
    main()
