"""Batch-1 greedy decode on one CUDA GPU: plain transformers against infopt recipes, in one process.

Usage:
    python benchmarks/gpu_decode.py --model default --recipes none,gpu-fast,int4,fp8 --json out.json
    python benchmarks/gpu_decode.py --model llama-1b --recipes none,gpu-fast,gpu-fast+int4 --json out.json
    python benchmarks/gpu_decode.py --model llama-1b --recipes gpu-fast --profile   # where each token's time goes
    python benchmarks/gpu_decode.py --model llama-8b --recipes gpu-fast,gpu-fast+int4-gemv@tuned \
        --gemv-tiles gemv.json   # the GEMV kernels on the fastest tiles of a gpu_gemv.py --sweep

For each recipe the model is loaded afresh in bf16 on the GPU, optimized, and timed: decode tokens/s is
``(n - 1) / (t(n) - t(1))`` over greedy generates of ``n`` and 1 new tokens (the prompt's cost cancels), the
median of ``--repeats``, with the GPU synchronized around each generate. Each row also records whether the
greedy tokens equal plain bf16 ``generate``'s, how many CUDA graph launches one generate made (torch.profiler's
``cudaGraphLaunch`` runtime calls: CUDA graphs replayed, not just captured), the weight bytes read per token and
the bandwidth that implies against a device-to-device copy, and the KL / top-1 of the recipe's own decode path
(compiled steps included) teacher-forced along plain ``generate``'s tokens against plain decoding (``decode_path``);
on the default model, lossy recipes also get KL and top-1 agreement against the bf16 model on the evaluation text
(``--quality``: a whole-sequence forward, which measures the weights, not the compiled step).

``llama-1b`` is a Llama built from a config with random weights (hidden 2048, 16 layers, 5632 MLP, 32/4 heads,
32k vocabulary: 0.84B parameters) and ``llama-8b`` one of Llama 3 8B's shapes (hidden 4096, 32 layers, 14336 MLP,
32/8 heads, 128k vocabulary: 8.0B parameters), both with random weights: their quality figures mean nothing and
are not computed. On an H100/H200 the 0.84B model's decode is bound by kernel launches (about 300 kernels of a few
microseconds per token, even inside a CUDA graph), not by reading its weights: weight-only quantization shows its
speed on the 8B model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import torch

import infopt
from infopt.bench.harness import machine_info, measure_bandwidth, weight_bytes_per_token
from infopt.eval import decode_path_logits, first_difference, logit_metrics

QUANT = {
    "int8": {"method": "int8"},
    "int4": {"method": "int4", "group_size": 64},
    "fp8": {"method": "fp8"},
    # infopt's Triton GEMV kernels at decode rows (infopt.ops.triton_gemv): int4 on tinygemm's values, FP8
    # weights with activations left in bf16, int8 per channel
    "int4-gemv": {"method": "int4", "group_size": 64, "cuda_kernel": "gemv"},
    "fp8-wo": {"method": "fp8", "activations": "none"},
    "int8-gemv": {"method": "int8", "cuda_kernel": "gemv"},
}
GEMLITE = {"int4-gemlite": 4}
"""Benchmark-only recipes: every decoder projection replaced by a ``gemlite`` weight-only layer (int4 g64 on infopt's
round-to-nearest codes), then ``gpu-fast``'s steps; q/k/v and gate/up stay separate (infopt's fusion takes its own
layer classes only). A measurement of the package's kernels inside infopt's compiled step, not an infopt recipe."""
FAST = [{"attention": {"backend": "sdpa"}}, {"kvcache": {"kind": "static"}}, {"compile": {"mode": "reduce-overhead"}}]


def recipe_steps(name: str):
    """``none``, a preset, a quantizer above, ``gpu-fast+<quantizer>``, or ``gpu-fast-unfused`` (the preset with
    separate q/k/v and gate/up projections: what fusing them saves)."""
    if name == "none":
        return None
    if name == "gpu-fast-unfused":
        return {"steps": [*FAST[:2], {"compile": {"mode": "reduce-overhead", "fuse_projections": False}}]}
    if name in QUANT:
        return {"steps": [{"quantize": QUANT[name]}]}
    if name.startswith("gpu-fast+") and name.split("+", 1)[1] in GEMLITE:
        return {"steps": FAST, "gemlite": GEMLITE[name.split("+", 1)[1]]}
    if name.startswith("gpu-fast+"):
        return {"steps": [{"quantize": QUANT[name.split("+", 1)[1]]}, *FAST]}
    return name  # a preset


SHAPES = {  # Llamas built from a config with random weights: speed only, their quality figures mean nothing
    "llama-1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=4, vocab_size=32000),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
}


def gemlite_int4_(model, group_size: int = 64) -> int:
    """Replace each decoder layer's projections by gemlite int4 layers (``GEMLITE``); returns how many."""
    from gpu_gemv import gemlite_available, gemlite_int4_layer  # this folder: the kernel benchmark

    from infopt.quantize.formats.int4 import quantize_int4_grouped

    if not gemlite_available():
        raise RuntimeError("gemlite is not installed here (or cannot import without a CUDA device)")
    count = 0
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for attr, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear) and child.bias is None:
                    codes, scales, zeros = quantize_int4_grouped(child.weight.float(), group_size, zero_point="float")
                    setattr(parent, attr, gemlite_int4_layer(codes, scales, zeros))
                    count += 1
    torch.cuda.empty_cache()
    return count


def sweep_tiles(path: str) -> list[dict]:
    """The fastest tiles at one row for each weight shape and width (8 or 4 bits) of a ``benchmarks/gpu_gemv.py
    --sweep`` JSON, as :func:`infopt.ops.triton_gemv.set_gemv_tiles` takes them (fp8 and int8 weights share the
    8-bit kernel and so its tiles)."""
    with open(path) as f:
        doc = json.load(f)
    best: dict = {}
    for r in doc.get("sweep", []):
        if r.get("rows") != 1 or "gbs" not in r:
            continue
        bits = 4 if r["kernel"] == "gemv_int4" else 8
        key = (r["n"], r["k"], bits)
        if key not in best or r["gbs"] > best[key]["gbs"]:
            best[key] = r
    return [{"n": n, "k": k, "bits": bits, "group_size": doc["group_size"] if bits == 4 else None,
             "tiles": r["tiles"], "gbs": r["gbs"], "of_copy": r.get("of_copy")} for (n, k, bits), r in best.items()]


def use_tiles(tiles: list[dict] | None, tuned: bool) -> list[dict]:
    """Set the swept tiles for a ``@tuned`` recipe, the table's for any other; returns those set."""
    from infopt.ops.triton_gemv import set_gemv_tiles

    for t in tiles or ():
        set_gemv_tiles(t["n"], t["k"], t["bits"], tuple(t["tiles"]) if tuned else None, group_size=t["group_size"])
    return list(tiles or ()) if tuned else []


def load(name: str, seed: int = 0):
    if name == "default":
        from infopt.models import load_default

        model, tok = load_default(dtype=torch.bfloat16, device="cuda")
        return model, tok
    if name in SHAPES:
        from transformers import AutoModelForCausalLM, LlamaConfig

        cfg = LlamaConfig(**SHAPES[name], max_position_embeddings=4096, tie_word_embeddings=False)
        torch.manual_seed(seed)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.eval()
        return model, None
    raise SystemExit(f"--model {name!r}: default, " + " or ".join(SHAPES))


def prompt_ids(tok, model) -> torch.Tensor:
    if tok is not None:
        text = tok.apply_chat_template([{"role": "user", "content": "Explain how a transformer language model "
                                         "generates text, step by step, for a new engineer."}],
                                       add_generation_prompt=True, tokenize=False)
        return tok(text, return_tensors="pt").input_ids.cuda()
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, model.config.vocab_size, (1, 48), generator=g).cuda()


def timed_generate(model, ids, n: int) -> tuple[float, torch.Tensor]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def decode_rate(model, ids, n: int, repeats: int) -> tuple[float, torch.Tensor]:
    timed_generate(model, ids, n)  # warm-up (also compiles whatever the warm-up at apply time missed)
    rates, out = [], None
    for _ in range(repeats):
        t1, _ = timed_generate(model, ids, 1)
        tn, out = timed_generate(model, ids, n)
        rates.append((n - 1) / (tn - t1))
    return statistics.median(rates), out


def graph_launches(model, ids, n: int) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if "cudaGraphLaunch" in e.key)


def where_time_goes(model, ids, n: int = 64, top: int = 12) -> dict:
    """Per token of one greedy ``generate``: the host's busiest Python functions (cProfile, by own time, which
    cProfile inflates) and the GPU's kernel time and count (torch.profiler; kernels inside CUDA graphs included).
    Host time well above GPU time means decode is bound by the loop, not by the kernels."""
    import cProfile
    import pstats
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    model.generate(ids, **kw)
    torch.cuda.synchronize()
    prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (primitive calls, calls, own time, cumulative, callers)
    busiest = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    host = [{"function": f"{Path(f).name}:{line}({name})", "own_ms_per_token": round(v[2] / n * 1e3, 4),
             "calls_per_token": round(v[1] / n, 2)} for (f, line, name), v in busiest]
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        model.generate(ids, **kw)
        torch.cuda.synchronize()
    events = trace.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    kernels = sum(e.count for e in events if e.self_device_time_total > 0)
    # which kernels: the step's kernel count sets a floor (each costs a few microseconds even inside a graph)
    busy = sorted((e for e in events if e.self_device_time_total > 0), key=lambda e: e.self_device_time_total,
                  reverse=True)
    gpu_top = [{"kernel": e.key[:120], "per_token": round(e.count / n, 2),
                "us_per_token": round(e.self_device_time_total / n, 2),
                "us_each": round(e.self_device_time_total / max(e.count, 1), 2)} for e in busy[:2 * top]]
    return {"tokens": n, "wall_ms_per_token_under_cprofile": round(wall / n * 1e3, 3),
            "gpu_kernel_ms_per_token": round(gpu_us / n / 1e3, 4), "gpu_kernels_per_token": round(kernels / n, 1),
            "host_top": host, "gpu_top": gpu_top}


def quality(model, tok, ref_logits, ids) -> dict:
    with torch.no_grad():
        logits = model(ids).logits.float()
    m = logit_metrics(logits, ref_logits, ids)
    return {k: round(m[k], 5) for k in ("kl", "kl_max", "top1", "ppl", "ppl_ref")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="default")
    p.add_argument("--recipes", default="none,gpu-fast,int8,int4,fp8")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quality", action="store_true", help="KL / top-1 of each recipe against bf16 (default model)")
    p.add_argument("--profile", action="store_true",
                   help="per token: the host's busiest functions and the GPU's kernel time (where_time_goes)")
    p.add_argument("--gemv-tiles", default=None, metavar="SWEEP_JSON",
                   help="a benchmarks/gpu_gemv.py --sweep JSON: recipes named RECIPE@tuned run the GEMV kernels on its "
                        "fastest one-row tiles per layer shape (the others on the table's)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_decode.py needs a CUDA device")
    swept = sweep_tiles(args.gemv_tiles) if args.gemv_tiles else None
    if any(n.endswith("@tuned") for n in args.recipes.split(",")) and not swept:
        raise SystemExit("recipes named ...@tuned need --gemv-tiles SWEEP_JSON with one-row sweep rows")

    machine = machine_info("cuda")

    def summary(rows: list[dict]) -> dict:
        base = next((r.get("decode_tok_s") for r in rows if r["recipe"] == "none"), None)
        fast = next((r.get("decode_tok_s") for r in rows if r["recipe"] == "gpu-fast"), None)
        for r in rows:
            if base and r.get("decode_tok_s"):
                r["ratio_vs_plain"] = round(r["decode_tok_s"] / base, 2)
            if fast and r.get("decode_tok_s"):
                r["ratio_vs_gpu_fast"] = round(r["decode_tok_s"] / fast, 3)
        return {"machine": machine, "device_copy_gbs": bw, "model": args.model, "tokens": args.tokens,
                "repeats": args.repeats, "dtype": "bfloat16", "batch": 1, "recipes": args.recipes.split(","),
                "rows": rows}

    rows = []
    plain_out = plain_path = None
    eval_ids = ref_logits = None
    bw = measure_bandwidth(device="cuda")
    for name in args.recipes.split(","):
        row: dict = {"recipe": name}
        try:
            model, tok = load(args.model)
            ids = prompt_ids(tok, model)
            if args.quality and tok is not None and eval_ids is None:
                from infopt.eval.metrics import default_text, encode_text

                eval_ids = encode_text(default_text(), tok, max_tokens=512).cuda()
                with torch.no_grad():
                    ref_logits = model(eval_ids).logits.float()
            tuned = name.endswith("@tuned")
            row["gemv_tiles"] = use_tiles(swept, tuned)  # before the steps compile: a CUDA graph keeps its tiles
            steps = recipe_steps(name.removesuffix("@tuned"))
            t0 = time.perf_counter()
            if isinstance(steps, dict) and "gemlite" in steps:
                row["gemlite_layers"] = gemlite_int4_(model)
                steps = {"steps": steps["steps"]}
            if steps is not None:
                infopt.optimize(model, steps)
            row["apply_s"] = round(time.perf_counter() - t0, 1)
            rate, out = decode_rate(model, ids, args.tokens, args.repeats)
            row["decode_tok_s"] = round(rate, 1)
            row["weight_bytes_per_token"] = weight_bytes_per_token(model)
            row["weight_gbs"] = round(row["weight_bytes_per_token"] * rate / 1e9, 1)
            if plain_out is None and name == "none":
                plain_out = out
            if plain_out is not None:
                row["token_identical_to_plain"] = bool(torch.equal(out, plain_out))
                row["first_difference"] = first_difference(plain_out[0, ids.shape[1]:].tolist(),
                                                           out[0, ids.shape[1]:].tolist())
            row["cuda_graph_launches"] = graph_launches(model, ids, 16)
            if name != "none":
                from infopt.compile import compile_stats

                st = compile_stats(model)
                row["compile"] = st.as_dict() if st is not None else None
            if eval_ids is not None and name != "none":
                row["quality"] = quality(model, tok, ref_logits, eval_ids)
            # the recipe's own decode path (compiled steps included; the whole-sequence forward of `quality` runs
            # the eager prefill path), teacher-forced along plain generate's tokens, against plain decoding
            cont = None if plain_out is None else plain_out[0, ids.shape[1]:]
            if cont is not None:
                got = decode_path_logits(model, ids, cont)
                if name == "none":
                    plain_path = got
                else:
                    figures = logit_metrics(got, plain_path)
                    row["decode_path"] = {"kl_mean": round(figures["kl"], 6), "kl_max": round(figures["kl_max"], 5),
                                          "top1": round(figures["top1"], 4)}
            if args.profile:
                row["profile"] = where_time_goes(model, ids)
            del model
        except Exception as e:  # one recipe failing must not hide the others' figures
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc()[-3000:]
        torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
        result = summary(rows)
        if args.json:  # after each recipe: a run stopped by a time limit keeps the rows it measured
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    print(f"{'recipe':<22}{'tok/s':>9}{'ratio':>7}{'vs fast':>8}{'GB/s':>8}  identical  graphs  quality")
    for r in rows:
        print(f"{r['recipe']:<22}{r.get('decode_tok_s', 'error'):>9}{r.get('ratio_vs_plain', ''):>7}"
              f"{r.get('ratio_vs_gpu_fast', ''):>8}"
              f"{r.get('weight_gbs', ''):>8}  {str(r.get('token_identical_to_plain', '')):>9}"
              f"  {r.get('cuda_graph_launches', ''):>6}  {r.get('quality', r.get('error', ''))}")


if __name__ == "__main__":
    main()
