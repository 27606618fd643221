"""Whether Inductor's C++ flex-attention kernel reads key rows past the end of its keys on one-token decode shapes:
each query, key and value lives at the front of a larger buffer whose tail is NaN, so a kernel that reads past the
tensors' ends returns NaN (or, where the tail is finite, a wrong output) while eager flex attention and SDPA stay
finite and agree. Static shapes (one compile per key length), the causal mask transformers builds for a decode step.

    python benchmarks/studies/flex_cpu_probe.py [--lengths 2,4,7,8,9,12,16,24,32,64]

torch 2.13 on this project's 2-core CPU (results/flex_cpu_probe.json): NaN at 8 and 24 keys, the other lengths agree
with SDPA to 3e-7, and eager flex attention agrees at every length; why ``Attention("flex")`` is refused on CPU.
"""
from __future__ import annotations

import argparse
import json
import math

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def poisoned(shape: tuple[int, ...], tail: int = 4096) -> torch.Tensor:
    """Random values at the front of a buffer whose next ``tail`` elements are NaN."""
    n = math.prod(shape)
    buf = torch.full((n + tail,), float("nan"))
    buf[:n] = torch.randn(n)
    return buf[:n].view(shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2,4,7,8,9,12,16,24,32,64")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=16)
    args = ap.parse_args()
    torch.manual_seed(0)
    compiled = torch.compile(flex_attention, dynamic=False)
    rows = {}
    for n_keys in (int(x) for x in args.lengths.split(",")):
        q = poisoned((1, args.heads, 1, args.head_dim))
        k = poisoned((1, args.kv_heads, n_keys, args.head_dim))
        v = poisoned((1, args.kv_heads, n_keys, args.head_dim))
        last = n_keys - 1
        mask = create_block_mask(lambda b, h, qi, ki, last=last: ki <= qi + last, 1, None, 1, n_keys, device="cpu")
        gqa = args.kv_heads != args.heads
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.25, enable_gqa=gqa)
        eager = flex_attention(q, k, v, block_mask=mask, scale=0.25, enable_gqa=gqa)
        out = compiled(q, k, v, block_mask=mask, scale=0.25, enable_gqa=gqa)
        nan = bool(out.isnan().any())
        rows[n_keys] = {"compiled_nan": nan, "compiled_max_err": None if nan else float((out - ref).abs().max()),
                        "eager_max_err": float((eager - ref).abs().max())}
        print(n_keys, rows[n_keys], flush=True)
    print(json.dumps({"torch": torch.__version__, "rows": rows}))


if __name__ == "__main__":
    main()
