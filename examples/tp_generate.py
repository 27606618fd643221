"""Tensor-parallel generation: the same model split over N processes, checked against one process.

Run on one machine with N processes (gloo on CPU, nccl when CUDA is visible):

    torchrun --nproc-per-node 3 examples/tp_generate.py            # the default model: 9 heads / 3 KV heads
    torchrun --nproc-per-node 2 examples/tp_generate.py --tiny     # a tiny random Llama (4 heads / 2 KV heads)
    python examples/tp_generate.py --tiny                          # no torchrun: infopt.parallel.launch spawns 2

Rank 0 first generates with the whole model in one process, then every rank applies
``{parallel: {tensor: N}}`` and generates again; rank 0 prints the report, the text, per-rank
weight bytes, decode speed and ``identical: true|false``.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

import infopt
from infopt.models import load_default, load_default_tokenizer, tiny_model
from infopt.parallel import launch, local_bytes


def main(args) -> bool:
    if not dist.is_initialized():  # under torchrun: RANK, WORLD_SIZE, MASTER_ADDR/PORT come from the environment
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}" if dist.get_backend() == "nccl" else "cpu"
    if args.tiny:
        model, tok = tiny_model("llama", num_layers=4).to(device), load_default_tokenizer()
    else:
        model, tok = load_default(device=device)
    ids = tok(args.prompt, return_tensors="pt")["input_ids"].to(device)
    gen = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)

    reference = None
    if rank == 0:  # one process, the whole model; the other ranks wait at the barrier
        reference = model.generate(ids, **gen)
    dist.barrier()

    full = local_bytes(model)
    infopt.optimize(model, {"parallel": {"tensor": world}})
    model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up
    dist.barrier()
    t0 = time.perf_counter()
    out = model.generate(ids, **gen)
    seconds = time.perf_counter() - t0
    held = torch.tensor([local_bytes(model)])
    sizes = [torch.zeros_like(held) for _ in range(world)]
    dist.all_gather(sizes, held.to(device) if device != "cpu" else held)

    identical = None
    if rank == 0:
        identical = bool(torch.equal(out.cpu(), reference.cpu()))
        print(model.infopt)
        print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
        print(f"ranks: {world} ({dist.get_backend()}); weight bytes per rank: "
              + ", ".join(f"{int(s) / 2**20:.1f} MiB" for s in sizes) + f" of {full / 2**20:.1f} MiB")
        print(f"decode: {args.tokens / seconds:.1f} tokens/s over {args.tokens} tokens")
        print(f"identical: {str(identical).lower()}", flush=True)
    infopt.undo(model)
    return identical


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of the default model")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", default="The three rules of clean code are")
    parser.add_argument("--nprocs", type=int, default=None, help="without torchrun: processes to spawn")
    args = parser.parse_args()
    if "RANK" in os.environ:
        main(args)
        dist.destroy_process_group()
    else:
        results = launch(main, nprocs=args.nprocs or (2 if args.tiny else 3), args=(args,))
        raise SystemExit(0 if results[0] else 1)
