"""What new memory costs against memory kept, where an ``a8`` prompt dequantizes its weights and a GGUF load
transcodes them: both write large tensors once, and a new tensor past glibc's 32 MB threshold is new pages.

- ``fill``: ``fill_`` of a new 394 MB uint8 tensor (Llama-3.2-3B's int8 head, 128,256 x 3,072) against the same
  tensor filled again;
- ``dense_t``: ``a8.int4_dense_t`` of Llama-3.1-8B's MLP shapes in bf16 into a new tensor (the prompt path before
  ``a8.dense_scratch``) against into the kept buffer (after), and the bf16 GEMM of 512 prompt rows by it beside.

Median milliseconds of 5 calls each after one untimed call, 2 threads. Run on a quiet machine.

    python benchmarks/studies/fresh_pages.py [--json benchmarks/results/fresh_pages.json]
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

SHAPES = {"gate/up [14336, 4096]": (14336, 4096), "down [4096, 14336]": (4096, 14336)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(2)
    ms = lambda fn: 1e3 * median_time(fn, runs=5, warmup=1)  # noqa: E731
    n = 128256 * 3072
    kept = torch.empty(n, dtype=torch.uint8)
    out = {"machine": machine_info(), "command": " ".join(sys.argv),
           "fill_ms": {"new": ms(lambda: torch.empty(n, dtype=torch.uint8).fill_(1)), "kept": ms(lambda: kept.fill_(1))},
           "dense_t_ms": {}}
    if not a8.available():
        raise SystemExit("the C++ quant_linear kernel is not built here: nothing to measure for dense_t")
    for name, (rows, cols) in SHAPES.items():
        g = torch.Generator().manual_seed(0)
        weight, sm = a8.pack_blocked_int4(torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=g),
                                          torch.rand(rows, cols // 32, generator=g) * 0.01 + 1e-3,
                                          torch.full((rows, cols // 32), 8.0))
        buf = a8.dense_scratch(cols, rows, torch.bfloat16)
        w_t = a8.int4_dense_t(weight, sm, 32)
        x = torch.randn(512, cols, generator=g).bfloat16()
        out["dense_t_ms"][name] = {
            "new": ms(lambda: a8.int4_dense_t(weight, sm, 32)),  # noqa: B023
            "kept": ms(lambda: a8.int4_dense_t(weight, sm, 32, out=buf)),  # noqa: B023
            "gemm_512_rows": ms(lambda: torch.matmul(x, w_t)),  # noqa: B023
        }
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
