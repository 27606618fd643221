"""A 4k prompt with the MLPs whole or in 512-token slices (``generate.forward.mlps_in_slices``), on ``cpu-fast``'s
layers loaded from a GGUF file with a static cache.

``time``: both ways in one process, alternating, 3 rounds; prints the medians (2-core AVX2 machine, 2026-11-29,
Qwen2.5-0.5B's shapes: sliced 23.5 s, whole 29.6 s). ``peak``: one way per process, the peak RSS after the prompt
(run each a few times: sliced 1.13-1.17 GB, whole 1.59-1.67 GB).

    python benchmarks/studies/mlp_slices.py time /tmp/infopt-scaling/qwen2.5-0.5b.gguf
    python benchmarks/studies/mlp_slices.py peak /tmp/infopt-scaling/qwen2.5-0.5b.gguf --whole
"""

import argparse
import resource
import statistics
import time

import torch

import infopt
import infopt.generate.forward as fwd

p = argparse.ArgumentParser()
p.add_argument("mode", choices=["time", "peak"])
p.add_argument("gguf")
p.add_argument("--whole", action="store_true", help="(peak) the MLPs on the whole prompt")
args = p.parse_args()
torch.set_num_threads(2)
model, _ = infopt.load_quantized(args.gguf, activations="auto", tokenizer=False)
infopt.optimize(model, [{"kvcache": {"kind": "static", "max_length": 4352}}])
ids = torch.randint(100, 40000, (1, 4096), generator=torch.Generator().manual_seed(0))


def prompt(sliced: bool) -> float:
    fwd.MLP_ROWS = 512 if sliced else 10**9
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t


if args.mode == "peak":
    prompt(not args.whole)
    print(f"{'whole' if args.whole else 'sliced'}: peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
else:
    times = {True: [], False: []}
    for r in range(3):
        for sliced in ((True, False) if r % 2 == 0 else (False, True)):
            times[sliced].append(prompt(sliced))
    print(f"sliced {statistics.median(times[True]):.2f} s, whole {statistics.median(times[False]):.2f} s (medians of 3)")
