"""Profile the pieces of a speculative round on the default model: a k-token verify forward against a
1-token forward, an int4/int8 or layer-truncated draft's 1-token forward, and the crop cost.

Run: flock /tmp/infopt-bench.lock python benchmarks/studies/speculative_profile.py [--repeats 30]
"""

import argparse
import copy
import statistics
import time

import torch
from transformers import DynamicCache

from infopt.models import load_default

parser = argparse.ArgumentParser()
parser.add_argument("--repeats", type=int, default=30)
parser.add_argument("--context", type=int, default=200)
args = parser.parse_args()

torch.manual_seed(0)
model, tok = load_default()
ctx = torch.randint(100, 40000, (1, args.context))


KS = (1, 2, 3, 4, 6, 8, 10)


def timed(m, repeats):
    """Median ms of a k-token forward on a cache holding ``--context`` tokens, for every k in KS; the k values
    alternate inside each repeat so machine noise hits them alike."""
    cache = DynamicCache(config=m.config)
    m(input_ids=ctx, past_key_values=cache, use_cache=True)
    n = ctx.shape[1]
    xs = {k: [] for k in KS}
    for _ in range(repeats):
        for k in KS:
            ids = torch.randint(100, 40000, (1, k))
            pos = torch.arange(n, n + k)[None]
            t0 = time.perf_counter()
            m(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=k)
            xs[k].append(time.perf_counter() - t0)
            cache.crop(-k)
    return {k: statistics.median(v) * 1e3 for k, v in xs.items()}


def drafts():
    from infopt.quantize import Int4WeightOnly, Int8WeightOnly, quantize_

    yield "target fp32", model
    d = copy.deepcopy(model)
    quantize_(d, Int4WeightOnly(group_size=32))
    yield "int4 g32 copy", d
    d = copy.deepcopy(model)
    quantize_(d, Int4WeightOnly(group_size=32, include_lm_head=True))
    yield "int4 g32 + int8 head", d
    d = copy.deepcopy(model)
    quantize_(d, Int8WeightOnly(include_lm_head=True))
    yield "int8 copy + int8 head", d
    d = copy.deepcopy(model)
    d.model.layers = d.model.layers[:8]
    d.config.num_hidden_layers = 8
    yield "fp32 first 8 layers", d


with torch.inference_mode():
    for name, m in drafts():
        t = timed(m, args.repeats)
        print(f"{name:<22}", "  ".join(f"k={k}: {v:6.1f} ms ({v / t[1]:.2f}x)" for k, v in t.items()), flush=True)
