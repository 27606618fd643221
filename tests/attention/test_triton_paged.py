"""infopt's Triton kernels for paged attention (``infopt.ops.triton_paged``) against the reference (``decode_sdpa``
for decode-only steps, ``packed_sdpa`` for packed steps holding prompt chunks), and the engine's steps on them: on
CUDA natively, on CPU in Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is imported, hence a
subprocess)."""

import json
import os
import subprocess
import sys

import pytest

NUMERICS_SCRIPT = r"""
import json, sys, torch
from infopt.ops.paged_attention import decode_sdpa
from infopt.ops.triton_paged import paged_decode, kernel_calls
dev = sys.argv[1]
g = torch.Generator().manual_seed(0)
rows = []
cases = [  # heads, kv heads, head dim, block size, kv lengths, window, splits, dtype
    (4, 2, 16, 16, [1, 17, 40], None, 1, "float32"),
    (4, 2, 16, 16, [1, 17, 40], 5, 3, "float32"),
    (9, 3, 24, 8, [33, 2, 64, 9], None, 2, "float32"),
    (8, 8, 32, 4, [13], 6, 4, "float32"),
    (6, 1, 64, 16, [100, 7], None, None, "bfloat16"),
    (4, 2, 16, 16, [48, 16], 1, 2, "bfloat16"),
]
for h, h_kv, d, bs, lens, window, splits, dt in cases:
    dtype = getattr(torch, dt)
    nbs = [-(-n // bs) for n in lens]
    nb = sum(nbs) + 2
    k = torch.randn(nb, bs, h_kv, d, generator=g).to(dtype).to(dev)
    v = torch.randn(nb, bs, h_kv, d, generator=g).to(dtype).to(dev)
    perm = torch.randperm(nb, generator=g)
    table = torch.full((len(lens), max(nbs) + 1), nb - 1, dtype=torch.long)  # wider than needed, as buckets are
    used = 0
    for i, n in enumerate(nbs):
        table[i, :n] = perm[used:used + n]
        used += n
    q = torch.randn(len(lens), h, d, generator=g).to(dtype).to(dev)
    kl = torch.tensor(lens, device=dev)
    table = table.to(dev)
    ref = decode_sdpa(q.float(), k.float(), v.float(), table, kl, d ** -0.5, window)
    out = paged_decode(q, k, v, table, kl, d ** -0.5, window, splits)
    rows.append([dt, str(out.dtype), list(out.shape), list(ref.shape), float((out.float() - ref).abs().max())])
print(json.dumps({"rows": rows, "calls": kernel_calls()}))
"""

PREFILL_SCRIPT = r"""
import json, sys, torch
from infopt.ops.paged_attention import packed_sdpa, split_packed
from infopt.ops.triton_paged import paged_prefill, prefill_tiles, kernel_calls
dev = sys.argv[1]
g = torch.Generator().manual_seed(0)
rows = []
cases = [  # heads, kv heads, head dim, block size, (new, kv) per sequence, window, dtype
    (4, 2, 16, 16, [(5, 5), (1, 17), (20, 40)], None, "float32"),
    (4, 2, 16, 16, [(5, 5), (1, 17), (20, 40)], 5, "float32"),
    (9, 3, 24, 8, [(33, 33), (1, 2), (17, 64), (1, 9)], None, "float32"),
    (8, 8, 32, 4, [(13, 13)], 6, "float32"),
    (6, 1, 64, 16, [(40, 100), (7, 7)], None, "bfloat16"),
    (4, 2, 16, 16, [(3, 48), (16, 16)], 1, "bfloat16"),
]
for h, h_kv, d, bs, seqs, window, dt in cases:
    dtype = getattr(torch, dt)
    news = [a for a, _ in seqs]; lens = [b for _, b in seqs]
    nbs = [-(-n // bs) for n in lens]
    nb = sum(nbs) + 2
    k = torch.randn(nb, bs, h_kv, d, generator=g).to(dtype).to(dev)
    v = torch.randn(nb, bs, h_kv, d, generator=g).to(dtype).to(dev)
    perm = torch.randperm(nb, generator=g)
    table = torch.full((len(lens), max(nbs) + 1), nb - 1, dtype=torch.long)
    used = 0
    for i, n in enumerate(nbs):
        table[i, :n] = perm[used:used + n]; used += n
    n_tok = sum(news)
    q = torch.randn(n_tok, h, d, generator=g).to(dtype).to(dev)
    starts = [sum(news[:i]) for i in range(len(news))]
    table = table.to(dev)
    kl = torch.tensor(lens, device=dev)
    split = split_packed(news, lens, starts, bs, dev)
    ref = packed_sdpa(q.float(), k.float(), v.float(), table, kl, *split, d ** -0.5, window)
    tiles = torch.tensor(prefill_tiles(news), dtype=torch.int32, device=dev)
    out = paged_prefill(q, k, v, table, kl, torch.tensor(news, device=dev), torch.tensor(starts, device=dev), tiles,
                        d ** -0.5, window)
    rows.append([dt, str(out.dtype), list(out.shape), list(ref.shape), float((out.float() - ref).abs().max())])
print(json.dumps({"rows": rows, "calls": kernel_calls()}))
"""

ENGINE_SCRIPT = r"""
import json, sys, torch, infopt
from infopt.attention.paged import kernel_calls, set_cpu_kernel
from infopt.batching import Engine, SamplingParams
from infopt.kvcache import Paged
from infopt.models import tiny_model
dev, graphs, comp = sys.argv[1], sys.argv[2], sys.argv[3] == "compile"
graphs = graphs if graphs == "replay" else graphs == "True"
model = tiny_model("llama", max_positions=256).to(dev)
prompts = [[(5 * i + 3 * j) % 200 + 1 for j in range(4 + 9 * i)] for i in range(4)]
params = SamplingParams(max_new_tokens=8, ignore_eos=True)
set_cpu_kernel(False)
engine = Engine(model, max_batch_tokens=64, max_seqs=4, kv=Paged(num_blocks=64, block_size=8), cuda_graphs=graphs,
                compile=comp)
before = kernel_calls()
got = [o.token_ids for o in engine.generate(prompts, params)]
ran = {k: v - before[k] for k, v in kernel_calls().items()}
from infopt.ops.triton_paged import kernel_calls as tk
m = engine.metrics()
infopt.undo(model)
plain = [model.generate(torch.tensor([p], device=dev), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(p):]
         .tolist() for p in prompts]
print(json.dumps({"same": got == plain, "ran": ran, "launches": tk(), "compile": m.get("compile")}))
"""


def _run(script: str, device: str, *args: str) -> dict:
    pytest.importorskip("triton", reason="Triton is not installed (optional: the CUDA kernels)")
    env = {**os.environ, **({"TRITON_INTERPRET": "1"} if device == "cpu" else {})}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", script, device, *args], capture_output=True, text=True, env=env,
                         timeout=600, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_decode_kernel_matches_the_reference(device):
    """GQA groups of 1-9 heads, blocks of 4-16 slots, rows of a single key, sliding windows of 1-6 keys, one to four
    parts per row (split-K), tables wider than the rows need; fp32 to rounding, bf16 to its own rounding."""
    doc = _run(NUMERICS_SCRIPT, device)
    assert doc["calls"] == {"triton": 6, "triton_prefill": 0}
    for dt, out_dtype, shape, ref_shape, err in doc["rows"]:
        assert out_dtype == f"torch.{dt}" and shape == ref_shape, (dt, out_dtype, shape)
        assert err < (1e-5 if dt == "float32" else 2e-2), (dt, shape, err)


def test_packed_kernel_matches_the_reference(device):
    """Packed steps of fresh prompts, later prompt chunks (queries at the end of longer contexts), decode tokens and
    chunks longer than one program's 16 tokens, side by side; GQA groups of 1-9 heads, blocks of 4-16 slots, sliding
    windows of 1-6 keys; fp32 to rounding, bf16 to its own rounding."""
    doc = _run(PREFILL_SCRIPT, device)
    assert doc["calls"] == {"triton": 0, "triton_prefill": 6}
    for dt, out_dtype, shape, ref_shape, err in doc["rows"]:
        assert out_dtype == f"torch.{dt}" and shape == ref_shape, (dt, out_dtype, shape)
        assert err < (1e-5 if dt == "float32" else 2e-2), (dt, shape, err)


@pytest.mark.parametrize("graphs,compiled", [("replay", "eager"), ("False", "eager"), ("replay", "compile")])
def test_engine_steps_run_the_kernels_same_tokens(device, graphs, compiled):
    """The engine's decode-only steps go to the Triton decode kernel and its packed steps holding prompt chunks to
    the Triton packed kernel (a lone sequence's step to the reference), over the graphs' fixed buffers or the step's
    own tensors; a compiled engine calls both through ``infopt::paged_attention_triton`` and compiles nothing while
    serving; the greedy tokens are plain generate's."""
    doc = _run(ENGINE_SCRIPT, device, graphs, compiled)
    assert doc["same"], doc
    assert doc["launches"]["triton"] > 0 and doc["launches"]["triton_prefill"] > 0, doc
    if compiled == "eager":  # layer calls counted by the backend (a compiled graph counts none)
        assert doc["ran"]["triton"] > 0 and doc["ran"]["triton_prefill"] > 0 and doc["ran"]["cpu"] == 0, doc["ran"]
    else:
        assert doc["compile"]["compiles_after_warmup"] == 0 and doc["compile"]["eager_shapes"] == {}, doc["compile"]
        assert sum(doc["ran"].values()) == 0, doc["ran"]
