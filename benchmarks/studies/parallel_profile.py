"""Profile one rank of a 3-rank tensor-parallel decode on the default model: infopt's tensor_parallel_ against
transformers' own DistributedConfig(tp_size=3), 24 greedy tokens, cProfile of rank 0 (where the time goes:
matmuls vs waiting on collectives).

    torchrun --nproc-per-node 3 benchmarks/studies/parallel_profile.py infopt
    torchrun --nproc-per-node 3 benchmarks/studies/parallel_profile.py hf
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "infopt"
    if mode not in ("infopt", "hf"):
        raise SystemExit(f"mode={mode!r}; allowed: infopt, hf")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from infopt.models import default_model_dir

    path = str(default_model_dir())
    if mode == "hf":
        from transformers.distributed import DistributedConfig

        model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=3),
                                                     dtype=torch.float32)
    else:
        from infopt.parallel import tensor_parallel_

        model = tensor_parallel_(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    ids = torch.tensor([[1, 504, 2555, 282, 2837, 29, 254]])
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
        prof.disable()
        if dist.get_rank() == 0:
            print(f"{mode}: 24 tokens in {time.perf_counter() - t0:.2f} s (rank 0)")
            pstats.Stats(prof).sort_stats("tottime").print_stats(8)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
