"""Expert-parallel figures on a random-weight mixture-of-experts model: per-rank weight bytes, prefill and decode
speed, token identity with one process.

The model is built from a config on every rank with the same seed (no checkpoint is downloaded): Mixtral's
architecture at a size this machine can run, 8 layers, hidden 768, 12/4 heads, 8 experts of width 1536 per layer,
2 per token, a 32,000-token vocabulary (untied head): 294M parameters, 226M of them in experts.

    python benchmarks/parallel_ep.py single                                # one process: the reference
    python benchmarks/parallel_ep.py single --threads 1                    # ... on one core
    torchrun --nproc-per-node 2 benchmarks/parallel_ep.py ep               # {parallel: {expert: 2}}, all_to_all
    torchrun --nproc-per-node 2 benchmarks/parallel_ep.py ep --dispatch all_reduce
    ... --int8                                                             # int8 weight-only (fp32 compute) first

Rank 0 prints one JSON row and appends it to benchmarks/results/parallel.jsonl. ``single`` also writes the
reference tokens there, which the other modes compare with (``identical``).
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch
from parallel_tp import RESULTS, _gather, _peak_rss_mib, _timed_generate, report  # this folder: the TP benchmark


def build_model():
    import transformers as tf

    cfg = tf.MixtralConfig(vocab_size=32000, hidden_size=768, intermediate_size=1536, num_hidden_layers=8,
                           num_attention_heads=12, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                           tie_word_embeddings=False, sliding_window=None, bos_token_id=1, eos_token_id=2,
                           pad_token_id=2)
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return tf.AutoModelForCausalLM.from_config(cfg).eval()


def _prompt(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, 32000, (1, n), generator=g)


def run(mode: str, tokens: int, prompt: int, long_prompt: int, dispatch: str, int8: bool, threads: int | None) -> dict:
    import torch.distributed as dist

    from infopt.parallel import local_bytes

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if mode != "single":
        dist.init_process_group("gloo")
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // world))
    row = {"bench": "expert_parallel", "mode": mode, "dispatch": dispatch if mode == "ep" else None, "int8": int8,
           "tokens": tokens, "prompt_tokens": prompt, "long_prompt_tokens": long_prompt, "dtype": "float32",
           "model": "random Mixtral: 8 layers, hidden 768, 8 experts x 1536, top-2, vocab 32000",
           "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(), "world": world,
           "threads_per_rank": torch.get_num_threads()}
    model = build_model()
    if int8:
        from infopt.quantize import Int8WeightOnly, quantize_

        quantize_(model, Int8WeightOnly(compute_dtype="float32"))  # experts too: one Int8Linear per expert
    full = local_bytes(model)
    if mode == "ep":
        from infopt.parallel import expert_parallel_

        expert_parallel_(model, dispatch=dispatch)
    held = local_bytes(model)
    out, first, tps = _timed_generate(model, _prompt(prompt), tokens)
    long_ids = _prompt(long_prompt)
    model.generate(long_ids, max_new_tokens=1, do_sample=False)  # warm-up at this length
    t0 = time.perf_counter()
    model.generate(long_ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
    prefill = time.perf_counter() - t0
    row.update(weight_bytes_unsharded=full, first_token_s=round(first, 3), decode_tokens_per_s=round(tps, 2),
               long_prefill_s=round(prefill, 3), long_prefill_tokens_per_s=round(long_prompt / prefill, 1),
               new_tokens=[int(t) for t in out[0, prompt:]])
    peak = _peak_rss_mib()
    if mode == "single":
        row.update(weight_bytes_per_rank=[held], peak_rss_mib_per_rank=[round(peak, 1)])
    else:
        row.update(weight_bytes_per_rank=[int(x) for x in _gather(held)],
                   peak_rss_mib_per_rank=[round(x, 1) for x in _gather(peak)])
        dist.barrier()
        dist.destroy_process_group()
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["single", "ep"])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=8, help="prompt length for the decode figures")
    parser.add_argument("--long-prompt", type=int, default=512, help="prompt length for the prefill figure")
    parser.add_argument("--dispatch", choices=["all_to_all", "all_reduce"], default="all_to_all")
    parser.add_argument("--int8", action="store_true", help="int8 weight-only (fp32 compute), experts included")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process (default: cores / ranks)")
    args = parser.parse_args()
    row = run(args.mode, args.tokens, args.prompt, args.long_prompt, args.dispatch, args.int8, args.threads)
    if int(os.environ.get("RANK", "0")) == 0:
        report(row, RESULTS / f"parallel_ep_reference{'_int8' if args.int8 else ''}.json",
               reference=args.mode == "single", key={"tokens": args.tokens, "prompt": args.prompt})


if __name__ == "__main__":
    main()
