"""A long prompt in one forward or in chunks over the cache (``generate.forward.PROMPT_ROWS``), on ``cpu-fast``'s
layers (a random model of a real checkpoint's shapes, quantized as it is built: ``benchmarks/cpu_scaling.py``'s
``build``) with a static cache: the time of the prompt's forward (``Forward.prefill``, what ``generate`` runs before its first
token) of ``--tokens`` prompt tokens for each chunk size, in one
process, the sizes alternating round by round (the order reversed every other round), and whether the logits are the
same bits as the whole prompt's.

    python benchmarks/studies/prompt_chunks.py qwen2.5-0.5b --rows 0 1024 --rounds 3 \\
        --json benchmarks/results/prompt_chunks_0.5b.json

``--rows 0`` is the whole prompt in one forward. Run on a quiet machine, one benchmark at a time.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cpu_scaling  # noqa: E402

import infopt.generate.forward as fwd  # noqa: E402
from infopt.generate import Forward  # noqa: E402
from infopt.kvcache.static import full_length_static_cache  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("size", help="a key of infopt.models.REAL_SIZES, e.g. qwen2.5-0.5b")
    p.add_argument("--rows", type=int, nargs="+", default=[0, 1024])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    model, _ = cpu_scaling.build(args.size)
    length = -(-(args.tokens + 8) // 256) * 256
    cache = full_length_static_cache(model.config, length)  # the static cache cpu-fast's loop fills
    forward = Forward(model)
    built_s = time.perf_counter() - t0
    ids = torch.randint(100, 40000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(args.tokens)[None]

    @torch.no_grad()
    def prompt(rows: int) -> tuple[float, torch.Tensor]:
        fwd.PROMPT_ROWS = rows
        cache.reset()
        t = time.perf_counter()
        logits = forward.prefill(ids, positions, None, cache)[:, -1].float()
        return time.perf_counter() - t, logits

    prompt(args.rows[0])  # the first call allocates the cache and the kept buffers
    times: dict[int, list[float]] = {r: [] for r in args.rows}
    logits: dict[int, torch.Tensor] = {}
    for r in range(args.rounds):
        for rows in (args.rows if r % 2 == 0 else args.rows[::-1]):
            s, lg = prompt(rows)
            times[rows].append(s)
            logits[rows] = lg
            print(f"round {r} rows {rows}: {s:.2f} s", flush=True)
    ref = logits[args.rows[0]]
    result = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "size": args.size, "tokens": args.tokens, "torch": torch.__version__, "built_s": built_s,
        "seconds": {str(r): v for r, v in times.items()},
        "median_s": {str(r): statistics.median(v) for r, v in times.items()},
        "tokens_per_s": {str(r): args.tokens / statistics.median(v) for r, v in times.items()},
        "same_logits_as_first": {str(r): bool(torch.equal(lg, ref)) for r, lg in logits.items()},
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    print(json.dumps({k: result[k] for k in ("median_s", "tokens_per_s", "same_logits_as_first")}))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
