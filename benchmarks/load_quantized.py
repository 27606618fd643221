"""Loading the shipped SmolLM2-135M-Instruct Q4_1 GGUF: transformers' dense GGUF loader vs ``infopt.load_quantized``.

Usage: python benchmarks/load_quantized.py [--repeat 3] [--json benchmarks/results/load_quantized.json]

Each load runs in a fresh process (after ``import torch, transformers, infopt``; the model code transformers imports
on first use is inside every timed call) and reports the median of ``--repeat`` processes:

- ``seconds``: the load call, model and tokenizer;
- ``weights_mb``: parameters and buffers, each storage once (:func:`infopt.core.introspect.param_bytes`);
- ``rss_mb``: resident memory the load left after one forward pass (which reads every weight) and ``malloc_trim``
  (freed heap returned), above the level before the load;
- ``peak_mb``: the process's peak resident memory during the load and that forward, above the same level.

Scenarios: ``transformers-gguf`` is what ``load_default()`` runs on first use (``from_pretrained(gguf_file=...)``
dequantizing every tensor to fp32, plus the tokenizer; it then saves a cached folder); ``load_default-cached`` is
a later ``load_default()`` (the fp32 folder); ``load_quantized-*`` is ``load_default(quantized=True)``.
Then, in this process: KL / top-1 of the quantized models against the dense fp32 one on 256 tokens of
``infopt.eval``'s default text, and greedy decode speed (64 new tokens, median of 3). Run on a quiet machine.
"""

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

import infopt

CHILD = r"""
import ctypes, json, sys, time
import torch, transformers, infopt
from infopt.core.introspect import param_bytes
from infopt.models import default_gguf_path, default_model_dir, load_default

def mem():
    d = {l.split(':')[0]: int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(('VmRSS', 'VmHWM'))}
    return d['VmRSS'] / 1e3, d['VmHWM'] / 1e3

scenario = sys.argv[1]
path = default_gguf_path()
if scenario == "load_default-cached":
    default_model_dir()  # converted once, outside the timing
rss0, _ = mem()
t0 = time.perf_counter()
if scenario == "transformers-gguf":
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
elif scenario == "load_default-cached":
    model, tok = load_default()
else:
    model, tok = load_default(quantized=True, dtype=getattr(torch, scenario.rsplit("-", 1)[1]))
seconds = time.perf_counter() - t0
with torch.no_grad():  # touch every weight (a safetensors load maps the file and reads pages on first use)
    model(torch.tensor([[1, 2, 3, 4]]))
_, peak = mem()
ctypes.CDLL("libc.so.6").malloc_trim(0)
rss, _ = mem()
print(json.dumps({"seconds": seconds, "weights_mb": param_bytes(model) / 1e6, "rss_mb": rss - rss0,
                  "peak_mb": peak - rss0, "file_mb": path.stat().st_size / 1e6}))
"""

SCENARIOS = ("transformers-gguf", "load_default-cached", "load_quantized-float32", "load_quantized-bfloat16")


def child(scenario: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, scenario], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    loads = {}
    print(f"{'scenario':26s} {'seconds':>8s} {'weights MB':>11s} {'x file':>7s} {'RSS MB':>7s} {'peak MB':>8s}")
    for s in SCENARIOS:
        runs = [child(s) for _ in range(args.repeat)]
        row = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
        loads[s] = row
        print(f"{s:26s} {row['seconds']:8.2f} {row['weights_mb']:11.1f} {row['weights_mb'] / row['file_mb']:7.2f} "
              f"{row['rss_mb']:7.0f} {row['peak_mb']:8.0f}")

    from infopt.eval import compare, reference_logits
    from infopt.models import load_default

    dense, tok = load_default()
    ref = reference_logits(dense, tokenizer=tok, max_tokens=256)
    msgs = [{"role": "user", "content": "Write a short poem about the sea."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]

    def decode_tps(model) -> float:
        # warm-up: the first calls pay one-off setup (and a safetensors-mapped model reads its pages)
        model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)
            times.append(64 / (time.perf_counter() - t0))
        return round(statistics.median(times), 1)

    quality = {"dense-float32": {"kl": 0.0, "top1": 1.0, "decode_tok_s": decode_tps(dense)}}
    for name, dtype, reference in (("quantized-float32", torch.float32, False),
                                   ("quantized-bfloat16", torch.bfloat16, False),
                                   ("quantized-float32-reference", torch.float32, True)):
        from infopt.models import default_gguf_path
        from infopt.quantize.community import load_quantized

        model, _ = load_quantized(default_gguf_path(), dtype=dtype, reference=reference, tokenizer=False)
        fig = compare(model, ref)
        quality[name] = {"kl": fig["kl"], "top1": fig["top1"],
                         "decode_tok_s": None if reference else decode_tps(model)}
    print(f"\n{'model':30s} {'KL':>9s} {'top-1':>6s} {'decode tok/s':>13s}")
    for name, q in quality.items():
        tps = "-" if q["decode_tok_s"] is None else f"{q['decode_tok_s']:.1f}"
        print(f"{name:30s} {q['kl']:9.2e} {q['top1']:6.3f} {tps:>13s}")

    if args.json:
        args.json.write_text(json.dumps({
            "loads": loads, "quality": quality, "repeat": args.repeat, "threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "infopt": infopt.__version__,
        }, indent=2))


if __name__ == "__main__":
    main()
