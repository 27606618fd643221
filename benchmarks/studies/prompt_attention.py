"""A long prompt's attention in fp32 or in bf16 (``Attention(backend="sdpa_gqa", prompt_dtype="bfloat16")``), on
``cpu-fast``'s layers: a random model of a real checkpoint's shapes quantized as it is built
(``benchmarks/cpu_scaling.py``'s ``build``), its keys and values in a 16-bit static cache (``kvcache.Static(dtype=
"float16")``, as ``cpu-fast`` keeps them). Times the prompt's forward (``Forward.prefill``, what ``generate`` runs
before its first token) both ways in one process, alternating round by round (the order reversed every other
round), and compares the last position's logits (random weights: the figures say how far bf16 moves them, not
what a trained model's tokens do; docs/attention.md has the KL on the default model).

    python benchmarks/studies/prompt_attention.py qwen2.5-0.5b --tokens 4096 --rounds 3 \\
        --json benchmarks/results/prompt_attention_0.5b.json

Run on a quiet machine, one benchmark at a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cpu_scaling  # noqa: E402

from infopt.attention.backends import _attention_modules, set_backend_  # noqa: E402
from infopt.attention.gqa import PROMPT_DTYPE_ATTR  # noqa: E402
from infopt.core.introspect import inspect_model  # noqa: E402
from infopt.generate import Forward  # noqa: E402
from infopt.kvcache.static import full_length_static_cache  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("size", help="a key of infopt.models.REAL_SIZES, e.g. qwen2.5-0.5b")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(2)
    model, _ = cpu_scaling.build(args.size)
    set_backend_(model, "sdpa_gqa")
    modules = _attention_modules(model, inspect_model(model))
    length = -(-(args.tokens + 8) // 256) * 256
    cache = full_length_static_cache(model.config, length, dtype=torch.float16, upcast=False)
    forward = Forward(model)
    ids = torch.randint(100, 40000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(args.tokens)[None]

    @torch.no_grad()
    def prompt(dtype: str) -> tuple[float, torch.Tensor]:
        for m in modules:
            if dtype == "bfloat16":
                setattr(m, PROMPT_DTYPE_ATTR, torch.bfloat16)
            else:
                m.__dict__.pop(PROMPT_DTYPE_ATTR, None)
        cache.reset()
        t = time.perf_counter()
        logits = forward.prefill(ids, positions, None, cache)[0, -1].float()
        return time.perf_counter() - t, logits

    sides = ["float32", "bfloat16"]
    prompt(sides[0])  # the first call allocates the cache and the kept buffers
    times: dict[str, list[float]] = {s: [] for s in sides}
    logits: dict[str, torch.Tensor] = {}
    for r in range(args.rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            s, lg = prompt(side)
            times[side].append(s)
            logits[side] = lg
            print(f"round {r} {side}: {s:.2f} s", flush=True)
    ref, got = logits["float32"].double(), logits["bfloat16"].double()
    kl = torch.sum(ref.softmax(-1) * (ref.log_softmax(-1) - got.log_softmax(-1))).item()
    med = {s: statistics.median(v) for s, v in times.items()}
    result = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "size": args.size, "tokens": args.tokens, "torch": torch.__version__,
        "seconds": times, "median_s": med, "tokens_per_s": {s: args.tokens / v for s, v in med.items()},
        "speedup": med["float32"] / med["bfloat16"],
        "last_position": {"kl_nats": kl, "max_abs_diff": (ref - got).abs().max().item(),
                          "same_argmax": bool(ref.argmax() == got.argmax())},
    }
    print(json.dumps({k: result[k] for k in ("median_s", "speedup", "last_position")}))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
