"""CPU decode and prompt processing at real model sizes, infopt against llama.cpp on bit-identical weights.

For each size of :data:`infopt.models.REAL_SIZES` (random weights in a real checkpoint's shapes), a model is built one
decoder layer at a time, each layer quantized as it is made as ``cpu-fast`` quantizes (int4 in groups of 32, int8
head shared with a tied embedding, int8 activations where the CPU has the kernel), except that the int4 codes are
symmetric and every scale is rounded to fp16 first: so llama.cpp's Q4_0 and Q8_0 blocks hold those very weights, and
``infopt.export_gguf`` writes them as they are (its report must call every linear exact). infopt then runs the rest of
``cpu-fast`` (its attention step, static cache, decode step as an AOTInductor package) and llama.cpp (``llama-cpp-python``, in a venv of
its own) runs the exported file, each in its own process, rounds alternating, 2 threads each:

- ``tg``: decode tokens/s after a 32-token prompt (128 new tokens, greedy; llama-bench's tg128);
- ``pp``: prompt tokens/s of a 512-token prompt (time to the first token; llama-bench's pp512);
- ``ctx``: decode tokens/s after a long prompt (``--contexts``, default 4096), 32 new tokens;
- ``--file-type Q4_K_M``: both sides run the file llama.cpp's own quantizer makes from the exported Q4_0 one (Q4_K
  blocks, Q6_K for half the ``ffn_down`` and ``attn_v`` layers and the head, as the GGUF files people download are):
  no longer infopt's own codes, but the same file on both sides; ``--file-type Q4_0-llama``: the Q4_0 file llama.cpp's
  quantizer makes (an untied token embedding in Q4_0, the head in Q6_K, as a downloaded Q4_0 file has them);
- peak RSS of the process, the seconds from process start to the model being ready and to its first generated token
  (``--infopt-source gguf``, the default: infopt loads the exported file llama.cpp runs with
  ``load_quantized(activations="auto")`` into cpu-fast's layers and applies the rest of cpu-fast with a warm compile
  cache, llama.cpp maps the file; ``build``: infopt builds and quantizes the random model in its process).

Usage (one heavy process at a time, on a quiet machine)::

    python -m venv /tmp/llama-venv && /tmp/llama-venv/bin/pip install llama-cpp-python==0.3.36 numpy
    .venv/bin/python benchmarks/cpu_scaling.py run --sizes qwen2.5-0.5b --rounds 3 \\
        --llama-python /tmp/llama-venv/bin/python --json benchmarks/results/cpu_scaling.json

``run`` prepares each size once (build, export to ``--workdir``, prompt ids), then alternates ``infopt`` and
``llama`` processes (``--rounds`` each, the order flipped every round) and writes the medians, the ratios and every
round. Greedy tokens are compared between the two sides on the 32-token prompt (random weights: near-ties are common,
so a parting is reported with its position, not counted as an error).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
HERE = Path(__file__).resolve()
NEW_TOKENS, CTX_NEW = 128, 32


def _prompt_ids(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]  # inside the default tokenizer's 49,152 ids


def _rss_now_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- the infopt side (project venv) ------------------------------------------------------------------------------------
def build(size: str):
    """The random model of ``size``, quantized layer by layer as it is made (symmetric int4 g32 with fp16 scales, an
    int8 head with fp16 scales shared with a tied embedding), and the default tokenizer."""
    import torch
    from torch import nn

    from infopt.models import load_default_tokenizer, random_model
    from infopt.quantize import Int4WeightOnly, quantize_
    from infopt.quantize.formats import a8
    from infopt.quantize.formats.int4 import Int4Linear, quantize_int4_grouped

    torch.set_num_threads(2)
    cfg = Int4WeightOnly(group_size=32, symmetric=True, include_lm_head=True, share_embedding=True,
                         activations="auto")
    layout = "a8" if a8.resolve(cfg.activations, torch.device("cpu")) == "int8" else None

    def each_layer(layer: nn.Module) -> None:
        for name, mod in list(layer.named_modules()):
            if type(mod) is not nn.Linear:
                continue
            w = mod.weight.detach()
            codes, scales, zeros = quantize_int4_grouped(w, 32, True, cfg.zero_point)
            new = Int4Linear.from_codes(codes, scales.half().float(), zeros, group_size=32, bias=mod.bias,
                                        dtype=w.dtype, layout=layout)
            layer.set_submodule(name, new)

    model = random_model(size, each_layer=each_layer)
    quantize_(model, cfg)  # what is left: the head (int8) and a tied embedding
    head = model.get_output_embeddings()
    with torch.no_grad():
        head.weight_scale.copy_(head.weight_scale.half().float())
    return model, load_default_tokenizer()


def _gguf(args) -> Path:
    """The file both sides run: the exported Q4_0 one, or llama.cpp's requantization of it (``--file-type``)."""
    suffix = "" if args.file_type == "Q4_0" else f".{args.file_type}"
    return Path(args.workdir) / f"{args.size}{suffix}.gguf"


def prepare(args) -> None:
    import infopt

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model, tok = build(args.size)
    report = infopt.export_gguf(model, work / f"{args.size}.gguf", tok, type="Q4_0")
    inexact = report["rounded"] + report["requantized"] + report["quantized"]
    if inexact:
        raise SystemExit(f"{args.size}: export_gguf did not keep every linear exactly: {inexact[:5]}")
    prompts = {"tg": _prompt_ids(32, 1), "pp": _prompt_ids(512, 2),
               **{f"ctx{n}": _prompt_ids(n, 3) for n in args.contexts}}
    (work / f"{args.size}.prompts.json").write_text(json.dumps(prompts))
    print(json.dumps({"size": args.size, "gguf_bytes": report["bytes"], "linears": report["linears"]}))


class _Stamps:
    """A generate streamer timestamping each ``put`` (the first is the prompt)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def run_infopt(args) -> dict:
    import torch

    import infopt
    from infopt.compile import compile_stats

    prompts = json.loads((Path(args.workdir) / f"{args.size}.prompts.json").read_text())
    longest = max(len(v) for v in prompts.values())
    if args.infopt_source == "gguf":  # the file llama.cpp runs, into cpu-fast's layers: equal terms for RSS and load
        model, _ = infopt.load_quantized(_gguf(args), activations="auto", tokenizer=False)
        torch.set_num_threads(2)
    else:
        model, _ = build(args.size)
    stages = {"built": _rss_now_mb(), "peak_while_building": _peak_rss_mb()}
    length = -(-(longest + NEW_TOKENS + 8) // 256) * 256  # whole 256-slot buckets: one compiled step serves them all
    kv = {} if args.kv_dtype == "model" else {"dtype": args.kv_dtype}
    attention = {} if args.prompt_attention == "model" else {"prompt_dtype": args.prompt_attention}
    infopt.optimize(model, [{"attention": {"backend": "sdpa_gqa", **attention}},  # cpu-fast's attention step
                            {"kvcache": {"kind": "static", "max_length": length, **kv}},
                            {"compile": {"mode": "default", "aot": "auto", "warmup_batch_sizes": [1]}}])
    ready = time.perf_counter() - T0
    stages["optimized"] = _rss_now_mb()
    if args.mode == "warm":  # the compile cache filled for the timed rounds; nothing measured
        return {"side": "infopt", "warm": True, "ready_s": ready}

    def gen(ids: list[int], n: int):
        stamps = _Stamps()
        t0 = time.perf_counter()
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             streamer=stamps, pad_token_id=0)
        t1 = time.perf_counter()
        new = out[0, len(ids):].tolist()
        first = stamps.times[1] if len(stamps.times) > 1 else t1
        return new, first - t0, (n - 1) / (t1 - first) if n > 1 else None

    _, first, _ = gen(prompts["tg"], 4)  # the first call allocates its cache bucket
    first_token = time.perf_counter() - T0  # (an upper bound: the 4 tokens' end)
    tokens, ttft, tg = gen(prompts["tg"], NEW_TOKENS)
    out = {"side": "infopt", "size": args.size, "source": args.infopt_source, "ready_s": ready,
           "first_token_s": first_token, "tg_tokens_per_s": tg, "tg_ttft_ms": 1e3 * ttft, "tokens": tokens}
    stages["tg"] = _rss_now_mb()
    _, ttft, _ = gen(prompts["pp"], 1)
    out["pp_tokens_per_s"] = len(prompts["pp"]) / ttft
    stages["pp"] = _rss_now_mb()
    for key in (k for k in prompts if k.startswith("ctx")):
        _, ttft, rate = gen(prompts[key], CTX_NEW)
        out[f"{key}_tokens_per_s"], out[f"{key}_ttft_s"] = rate, ttft
        stages[key] = _rss_now_mb()
    out["rss_mb_after"] = stages
    stats = compile_stats(model)
    out["compiles_after_warmup"], out["cold_eager_calls"] = stats.compiles_after_warmup, stats.cold_eager_calls
    out["routing"] = dict(infopt.generate.routing_stats(model).loops)
    out["peak_rss_mb"] = _peak_rss_mb()
    return out


# -- the llama.cpp side (its own venv: llama_cpp and numpy only) -------------------------------------------------------
def run_llama(args) -> dict:
    import llama_cpp
    import numpy as np

    prompts = json.loads((Path(args.workdir) / f"{args.size}.prompts.json").read_text())
    longest = max(len(v) for v in prompts.values())
    llm = llama_cpp.Llama(str(_gguf(args)), n_ctx=longest + NEW_TOKENS + 8,
                          n_threads=2, n_threads_batch=2, n_batch=512, verbose=False)
    ready = time.perf_counter() - T0

    def last_argmax() -> int:  # the last evaluated token's logits, read in place from llama.cpp's buffer
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))))

    def gen(ids: list[int], n: int):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        tok = last_argmax()
        first = time.perf_counter()
        new = [tok]
        for _ in range(n - 1):
            llm.eval([tok])
            tok = last_argmax()
            new.append(tok)
        t1 = time.perf_counter()
        return new, first - t0, (n - 1) / (t1 - first) if n > 1 else None

    gen(prompts["tg"], 4)
    first_token = time.perf_counter() - T0  # (an upper bound: the 4 tokens' end)
    tokens, ttft, tg = gen(prompts["tg"], NEW_TOKENS)
    out = {"side": f"llama.cpp {args.file_type}", "size": args.size, "ready_s": ready, "first_token_s": first_token,
           "tg_tokens_per_s": tg, "tg_ttft_ms": 1e3 * ttft, "tokens": tokens, "llama_cpp_python": llama_cpp.__version__}
    _, ttft, _ = gen(prompts["pp"], 1)
    out["pp_tokens_per_s"] = len(prompts["pp"]) / ttft
    for key in (k for k in prompts if k.startswith("ctx")):
        _, ttft, rate = gen(prompts[key], CTX_NEW)
        out[f"{key}_tokens_per_s"], out[f"{key}_ttft_s"] = rate, ttft
    out["peak_rss_mb"] = _peak_rss_mb()
    return out


def requantize(args) -> dict:
    """(llama venv) llama.cpp's quantizer turns the exported Q4_0 file into ``--file-type`` (it dequantizes each
    tensor and quantizes it again with its own choice of block types per tensor)."""
    import llama_cpp

    src = Path(args.workdir) / f"{args.size}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{args.file_type.removesuffix('-llama')}")
    params.allow_requantize = True
    params.nthread = 2
    t0 = time.perf_counter()
    if llama_cpp.llama_model_quantize(str(src).encode(), str(_gguf(args)).encode(), params):
        raise SystemExit(f"llama_model_quantize failed for {src} -> {args.file_type}")
    return {"file_type": args.file_type, "bytes": _gguf(args).stat().st_size, "seconds": time.perf_counter() - t0}


# -- the orchestration (project venv) ----------------------------------------------------------------------------------
def _child(python: str, mode: str, args) -> dict:
    cmd = [python, str(HERE), mode, "--size", args.size_now, "--workdir", args.workdir,
           "--contexts", *map(str, args.contexts), "--infopt-source", args.infopt_source, "--kv-dtype", args.kv_dtype,
           "--prompt-attention", args.prompt_attention, "--file-type", args.file_type]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if res.returncode:
        raise SystemExit(f"{mode} {args.size_now} failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _median(rows: list[dict], key: str):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarize(result: dict) -> dict:
    """``result["table"]``: one row per size, in order (the doc figures read it by index), from its medians."""
    rows = []
    for size, got in result["sizes"].items():
        med, ratio = got["median"], got["ratio_infopt_over_llama"]
        if got.get("billions") is None:
            from infopt.models import REAL_SIZES

            got["billions"] = REAL_SIZES[size][1]
        row = {"size": size, "billions": got["billions"]}
        for key in ratio:
            name = key.removesuffix("_tokens_per_s")
            row[f"infopt_{name}"], row[f"llama_{name}"], row[f"ratio_{name}"] = (
                med["infopt"][key], med["llama"][key], ratio[key])
        rows.append(row)
    result["table"] = rows
    return result


def chart(result: dict, path: Path) -> Path:
    """Tokens/s of both sides against model size, one panel per figure (decode, prompt, decode after each long
    prompt)."""
    from matplotlib.figure import Figure

    rows = result["table"]
    names = [k.removeprefix("ratio_") for k in rows[0] if k.startswith("ratio_") and k.split("_", 1)[1] in
             ("tg", "pp") or k.startswith("ratio_ctx")]
    fig = Figure(figsize=(4 * len(names), 3.4))
    for i, name in enumerate(names):
        ax = fig.add_subplot(1, len(names), i + 1)
        x = [r["billions"] for r in rows]
        for side, mark in (("infopt", "o-"), ("llama", "s--")):
            ax.plot(x, [r[f"{side}_{name}"] for r in rows], mark, label="infopt" if side == "infopt" else
                    f"llama.cpp {result.get('file_type', 'Q4_0')}")
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("parameters (billions)")
        ax.set_ylabel("tokens/s")
        ax.set_title({"tg": "decode (tg128)", "pp": "prompt (pp512)"}.get(name, f"decode after {name[3:]} tokens"))
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def orchestrate(args) -> None:
    sizes = {}
    for size in args.sizes:
        args.size_now = args.size = size
        prompts = Path(args.workdir) / f"{size}.prompts.json"
        base = Path(args.workdir) / f"{size}.gguf"  # the exported file a requantization starts from
        if args.reuse and base.exists() and prompts.exists() and \
                set(json.loads(prompts.read_text())) >= {f"ctx{n}" for n in args.contexts}:
            prepared = {"size": size, "reused": str(base), "gguf_bytes": base.stat().st_size}
        else:
            prep = subprocess.run([sys.executable, str(HERE), "prepare", "--size", size, "--workdir", args.workdir,
                                   "--contexts", *map(str, args.contexts)], capture_output=True, text=True,
                                  check=False)
            if prep.returncode:
                raise SystemExit(f"prepare {size} failed:\n{prep.stderr[-4000:]}")
            prepared = json.loads(prep.stdout.strip().splitlines()[-1])
        if args.file_type != "Q4_0":
            if args.reuse and "reused" in prepared and _gguf(args).exists():
                prepared["requantized"] = {"reused": str(_gguf(args)), "bytes": _gguf(args).stat().st_size}
            else:
                prepared["requantized"] = _child(args.llama_python, "requantize", args)
        warm = _child(sys.executable, "warm", args)  # so no timed round compiles (a source change drops the cache)
        print(f"{size} warm-up (compile cache): {warm['ready_s']:.1f} s", flush=True)
        rounds = []
        for r in range(args.rounds):
            order = ("infopt", "llama") if r % 2 == 0 else ("llama", "infopt")
            got = {}
            for side in order:
                got[side] = _child(sys.executable if side == "infopt" else args.llama_python, side, args)
                print(f"{size} round {r + 1} {side}: tg {got[side]['tg_tokens_per_s']:.2f} tok/s, "
                      f"pp {got[side]['pp_tokens_per_s']:.1f} tok/s", flush=True)
            rounds.append(got)
        keys = ["tg_tokens_per_s", "pp_tokens_per_s", *[f"ctx{n}_tokens_per_s" for n in args.contexts],
                "peak_rss_mb", "ready_s", "first_token_s", "tg_ttft_ms"]
        med = {side: {k: _median([g[side] for g in rounds], k) for k in keys} for side in ("infopt", "llama")}
        # ratios per round (the two processes of a round ran back to back), then their median
        ratio = {k: _median([{k: g["infopt"][k] / g["llama"][k]} for g in rounds
                             if g["infopt"].get(k) and g["llama"].get(k)], k) for k in keys}
        a, b = rounds[0]["infopt"]["tokens"], rounds[0]["llama"]["tokens"]
        parted = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        from infopt.models import REAL_SIZES

        sizes[size] = {"billions": REAL_SIZES[size][1], "prepare": prepared,
                       "median": med,
                       "ratio_infopt_over_llama": ratio, "greedy_parted_at": parted, "rounds": rounds}
        print(json.dumps({size: {"median": med, "ratio": ratio, "greedy_parted_at": parted}}, indent=1), flush=True)
    import platform

    import torch

    what = ("infopt (cpu-fast's steps, symmetric int4 codes) against llama.cpp Q4_0 on the same weights"
            if args.file_type == "Q4_0" else f"infopt (cpu-fast's steps on the file's blocks) against llama.cpp, both "
            f"on llama.cpp's {args.file_type} requantization of the exported Q4_0 file")
    result = {"what": what + ", random weights in real checkpoints' shapes, 2 threads each, alternating processes",
              "file_type": args.file_type,
              "infopt_source": args.infopt_source, "infopt_kv_dtype": args.kv_dtype,
              "infopt_prompt_attention": args.prompt_attention,
              "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                          "date": time.strftime("%Y-%m-%d")},
              "command": " ".join(sys.argv), "sizes": sizes}
    summarize(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json} and {chart(result, Path(args.json).with_suffix('.png'))}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["run", "prepare", "warm", "infopt", "llama", "requantize", "summarize"])
    p.add_argument("--size", help="(prepare, infopt, llama) one of infopt.models.REAL_SIZES")
    p.add_argument("--sizes", nargs="+", default=["qwen2.5-0.5b"], help="(run) the sizes, in order")
    p.add_argument("--contexts", nargs="*", type=int, default=[4096], help="long prompts to decode after")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workdir", default="/tmp/infopt-scaling")
    p.add_argument("--llama-python", default="/tmp/llama-venv/bin/python")
    p.add_argument("--json")
    p.add_argument("--reuse", action="store_true",
                   help="(run) keep the files a previous run prepared in --workdir (the same weights for a second run)")
    p.add_argument("--file-type", choices=["Q4_0", "Q4_0-llama", "Q4_K_M"], default="Q4_0",
                   help="Q4_0: the exported file (infopt's own codes); Q4_K_M, Q4_0-llama: llama.cpp's "
                        "requantization of it (Q4_0-llama: a Q4_0 file as its quantizer writes one, the untied token "
                        "embedding in Q4_0 and the head in Q6_K)")
    p.add_argument("--infopt-source", choices=["gguf", "build"], default="gguf",
                   help="gguf: infopt loads the exported file llama.cpp runs (load_quantized(activations='auto')), "
                        "so peak RSS and the time to the first token compare on equal terms; build: the random model "
                        "built and quantized in the process")
    p.add_argument("--kv-dtype", choices=["float16", "model"], default="float16",
                   help="infopt's static KV cache: float16 (cpu-fast's, and llama.cpp's default f16 cache) or the "
                        "model's own fp32")
    p.add_argument("--prompt-attention", choices=["bfloat16", "model"], default="bfloat16",
                   help="infopt's prompts of 64+ tokens attend in bfloat16 where the CPU has native bf16 (cpu-fast's "
                        "attention step) or in the model's fp32")
    args = p.parse_args()
    if args.mode == "run":
        orchestrate(args)
    elif args.mode == "summarize":  # recompute the table of a results file (--json), and its chart
        path = Path(args.json)
        path.write_text(json.dumps(summarize(json.loads(path.read_text())), indent=1))
        print(f"wrote {chart(json.loads(path.read_text()), path.with_suffix('.png'))}")
    elif args.mode == "prepare":
        prepare(args)
    elif args.mode == "requantize":
        print(json.dumps(requantize(args)))
    else:
        print(json.dumps(run_infopt(args) if args.mode in ("infopt", "warm") else run_llama(args)))


if __name__ == "__main__":
    main()
