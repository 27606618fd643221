"""fp32 ``F.linear`` time by row count M on this CPU, for the default model's projection shapes.

On the development machine (torch 2.13.0+cpu, MKL), 2 and 3 rows cost about 2x and 3x one row, while 4 to 8 rows
cost less than 3 rows: a slow path for M = 2..3. Speculative verify rounds of 2-3 tokens and batching-engine steps
with 2-3 sequences pay it.

    python benchmarks/studies/small_m_matmul.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {"q/o_proj": (576, 576), "gate/up_proj": (1536, 576), "down_proj": (576, 1536), "lm_head": (49152, 576)}
ROWS = (1, 2, 3, 4, 6, 8)


def main() -> None:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of 50 calls, microseconds")
    print(f"{'shape':<14}" + "".join(f"{'M=' + str(m):>10}" for m in ROWS))
    for name, (out_f, in_f) in SHAPES.items():
        w = torch.randn(out_f, in_f)
        cells = []
        for m in ROWS:
            x = torch.randn(m, in_f)
            for _ in range(20):
                F.linear(x, w)
            ts = []
            for _ in range(50):
                t = time.perf_counter()
                F.linear(x, w)
                ts.append(time.perf_counter() - t)
            cells.append(statistics.median(ts) * 1e6)
        print(f"{name:<14}" + "".join(f"{c:>10.0f}" for c in cells))


if __name__ == "__main__":
    main()
