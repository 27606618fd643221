"""Engine decode speed with 1-4 concurrent sequences on the default model (the tail of a batch, where steps carry
2-3 rows and fp32 matmuls take their slow path; see benchmarks/studies/small_m_matmul.py).

    python benchmarks/studies/batching_small_steps.py
"""

from __future__ import annotations

import statistics
import time

from infopt.batching import Engine, SamplingParams
from infopt.kvcache import Paged
from infopt.models import load_default


def main() -> None:
    model, tok = load_default()
    engine = Engine(model, tok, kv=Paged(num_blocks=200, prefix_caching=False))
    prompts = [[1, 504, 2555 + i, 282, 2837, 29, 254] for i in range(4)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    for n in (1, 2, 3, 4):
        times = []
        for _ in range(3):
            t = time.perf_counter()
            engine.generate(prompts[:n], params)
            times.append(time.perf_counter() - t)
        print(f"{n} sequences: {40 * n / statistics.median(times):.1f} tokens/s (median of 3, prefill included)")


if __name__ == "__main__":
    main()
