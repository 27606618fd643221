"""Does llama.cpp run what ``infopt.export_gguf`` writes, on the same weights? Greedy tokens of llama.cpp against
infopt's model loaded from the same file.

Two steps, in two environments (llama.cpp through ``llama-cpp-python``, built from source by pip in its own venv,
as ``benchmarks/llamacpp_compare.py`` describes):

    .venv/bin/python benchmarks/gguf_export_check.py --prepare /tmp/gguf-export
    /tmp/llama-venv/bin/python benchmarks/gguf_export_check.py --check /tmp/gguf-export \\
        --json benchmarks/results/gguf_export_llamacpp.json

``--prepare`` exports the default model (fp32, dense: the shipped Q4_1 file dequantized) as F32, Q8_0 and Q4_0 with
its tokenizer, loads each file back with ``infopt.load_quantized(..., reference=True)`` (the file's own weights in
fp32 arithmetic), and records each one's greedy tokens after a chat prompt, with the top-2 logit margin of every
step, and the prompt's ids as the file's tokenizer encodes them. ``--check`` loads each file in llama.cpp, tokenizes
the same chat text with the file's vocabulary, greedy-decodes from the recorded prompt, and reports where (if
anywhere) its tokens first part from infopt's, with infopt's margin there. llama.cpp multiplies Q4_0 and Q8_0 weights
with activations rounded to 8 bits (its ``q8_0`` dot products) and F32 ones in fp32, so the F32 file is the
bit-for-bit check of the export and the quantized ones check the blocks (a part at a small margin is rounding).

Both steps also compare whole distributions on the same weights: ``--prepare`` keeps infopt's log-probabilities over
the prompt and its greedy tokens (teacher-forced), in fp32 reference arithmetic and in ``load_quantized``'s fast
layers; ``--check`` runs llama.cpp over the same sequence and reports KL(llama.cpp || infopt) per position (mean,
max) and top-1 agreement: what remains is arithmetic (activation rounding, summation order), not weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--prepare", help="(project venv) export the default model into this folder, record infopt's tokens")
p.add_argument("--check", help="(llama.cpp venv) the folder --prepare wrote")
p.add_argument("--types", nargs="+", default=["F32", "Q8_0", "Q4_0"])
p.add_argument("--new-tokens", type=int, default=48)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--json", default=None)
p.add_argument("--rope", choices=["model", "llama3", "linear"], default="model",
               help="(prepare) give the model a scaled rotary embedding first (llama3: factor 8, original context 64, "
                    "so that every position past 16 is scaled; linear: factor 4): checks that llama.cpp computes "
                    "the positions the exported scaling says")
p.add_argument("--family", choices=["default", "qwen3", "gemma3"], default="default",
               help="(prepare) default: the embedded model; qwen3 / gemma3: a random model of that family (6 layers, "
                    "peaked logits from a wide initialisation, the default tokenizer's vocabulary), checking what "
                    "the export writes for the family: Qwen3's q/k norms and a head size other than hidden / heads, "
                    "Gemma 3's 1 + w norms, sliding window (16 here, so the sequence slides), five sliding layers to "
                    "one full, attention scale and embedding scale")
args = p.parse_args()
TEXT = [{"role": "user", "content": "Name three planets of the solar system and one fact about each."}]

if args.prepare:
    import numpy as np
    import torch

    import infopt
    from infopt.models import load_default

    out = Path(args.prepare)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = load_default()
    if args.family != "default":
        from transformers import AutoModelForCausalLM, Gemma3TextConfig, Qwen3Config

        shapes = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=model.config.vocab_size, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                      # wide enough for peaked logits, not so wide that Gemma's embedding scale (x16 here) makes
                      # every position predict its own token (mean entropy over the check: about 6 and 8 nats)
                      initializer_range=0.2 if args.family == "qwen3" else 0.1,
                      eos_token_id=tok.eos_token_id)
        config = (Qwen3Config(**shapes, head_dim=96, rope_theta=1e6) if args.family == "qwen3" else
                  Gemma3TextConfig(**shapes, head_dim=64, query_pre_attn_scalar=64, sliding_window=16))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        if args.family == "gemma3":  # Gemma's norms scale by 1 + w: give w values (bf16-exact, so 1 + w is exact)
            gen = torch.Generator().manual_seed(1)
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.data = (torch.randn(param.shape, generator=gen) * 0.3).bfloat16().float()
    if args.rope != "model":
        theta = model.config.rope_parameters["rope_theta"]
        model.config.rope_parameters = {"llama3": {"rope_type": "llama3", "rope_theta": theta, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 64},
                                        "linear": {"rope_type": "linear", "rope_theta": theta, "factor": 4.0}}[args.rope]
        model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    doc = {"text": TEXT, "new_tokens": args.new_tokens, "rope": model.config.rope_parameters, "family": args.family,
           "files": {}}
    stem = "smollm2-135m-instruct" if args.family == "default" else f"random-{args.family}"
    for kind in args.types:
        path = out / f"{stem}.export.{kind}.gguf"
        report = infopt.export_gguf(model, path, tok, type=kind, pre="smollm")
        loaded, ltok = infopt.load_quantized(path, reference=True)
        ids = ltok.apply_chat_template(TEXT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = ids["input_ids"]
        with torch.no_grad():
            gen = loaded.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, output_scores=True,
                                  return_dict_in_generate=True)
        margins = [round(float(s[0].topk(2).values[0] - s[0].topk(2).values[1]), 5) for s in gen.scores]
        # log-probabilities over the whole sequence (prompt + infopt's tokens), teacher-forced: the file's weights in
        # infopt's reference arithmetic (fp32) and in its fast kernels (load_quantized's default layers)
        seq = gen.sequences[:, :-1]
        fast, _ = infopt.load_quantized(path)
        with torch.no_grad():
            for name, m in (("reference", loaded), ("fast", fast)):
                lp = torch.log_softmax(m(seq).logits[0].float(), dim=-1)
                np.save(out / f"{kind}.{name}.logprobs.npy", lp.numpy())
        doc["files"][kind] = {"file": path.name, "bytes": report["bytes"], "linears": report["linears"],
                              "prompt_ids": ids[0].tolist(), "infopt_tokens": gen.sequences[0, ids.shape[1]:].tolist(),
                              "infopt_margins": margins, "sequence": seq[0].tolist()}
        print(kind, report["linears"], report["bytes"], flush=True)
        if args.family == "gemma3" and kind == "F32":  # how far a file read the wrong way lands: a KL near 0 from
            # llama.cpp must be small against these to mean that it computes what the model does
            ref = torch.log_softmax(loaded(seq).logits[0].float(), dim=-1).double()

            def wrong(change, path=path, seq=seq, ref=ref) -> float:
                m, _ = infopt.load_quantized(path, reference=True, tokenizer=False)
                change(m)
                with torch.no_grad():
                    lp = torch.log_softmax(m(seq).logits[0].float(), dim=-1).double()
                return float((ref.exp() * (ref - lp)).sum(-1).mean())

            def no_window(m):
                m.config.sliding_window = 1 << 20  # the masks read the config: every layer sees the whole sequence

            def scale_256(m):
                for layer in m.model.layers:
                    layer.self_attn.scaling = 256 ** -0.5

            def norms_plus_one(m):
                for name, param in m.named_parameters():
                    if "norm" in name:
                        param.data += 1

            with torch.no_grad():
                doc["wrong_reads_kl"] = {"no_sliding_window": wrong(no_window),
                                         "attention_scale_1_over_sqrt_256": wrong(scale_256),
                                         "norm_weights_with_the_1_left_on": wrong(norms_plus_one)}
            print("KL of wrong reads against the model:", doc["wrong_reads_kl"], flush=True)
    (out / "infopt.json").write_text(json.dumps(doc))
    sys.exit(0)

import llama_cpp  # noqa: E402
import numpy as np  # noqa: E402

folder = Path(args.check)
doc = json.loads((folder / "infopt.json").read_text())
results = {}
for kind, rec in doc["files"].items():
    llm = llama_cpp.Llama(model_path=str(folder / rec["file"]), n_ctx=512, n_threads=args.threads,
                          n_threads_batch=args.threads, logits_all=True, verbose=False)
    prompt = rec["prompt_ids"]
    # the chat prompt's text, tokenized again by llama.cpp with the file's vocabulary (special tokens parsed)
    own = llm.tokenize(llm.detokenize(prompt, special=True), add_bos=False, special=True)
    llm.reset()
    llm.eval(prompt)
    toks = []
    for _ in range(len(rec["infopt_tokens"])):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
        tok = int(np.argmax(logits))
        toks.append(tok)
        llm.eval([tok])
    first = next((i for i, (a, b) in enumerate(zip(toks, rec["infopt_tokens"], strict=True)) if a != b), None)
    # llama.cpp's log-probabilities over infopt's sequence, against infopt's: KL(llama.cpp || infopt) per position
    llm.reset()
    llm.eval(rec["sequence"])
    n = len(rec["sequence"])
    theirs = np.asarray(llm.scores[:n], dtype=np.float64)
    theirs = theirs - theirs.max(-1, keepdims=True)
    theirs = theirs - np.log(np.exp(theirs).sum(-1, keepdims=True))
    agree = {}
    for name in ("reference", "fast"):
        f = folder / f"{kind}.{name}.logprobs.npy"
        if not f.exists():
            continue
        ours = np.load(f, allow_pickle=False).astype(np.float64)
        ours = ours - ours.max(-1, keepdims=True)  # renormalized in float64, as llama.cpp's are
        ours = ours - np.log(np.exp(ours).sum(-1, keepdims=True))
        kl = (np.exp(theirs) * (theirs - ours)).sum(-1)
        agree[name] = {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                       "top1": float((theirs.argmax(-1) == ours.argmax(-1)).mean()), "positions": n,
                       # how peaked infopt's distributions are (nats; ln(vocab) would be uniform): a KL near 0 means
                       # something only where the logits are not flat
                       "entropy_mean": float(-(np.exp(ours) * ours).sum(-1).mean())}
    results[kind] = {"file": rec["file"], "linears": rec["linears"], "same_tokens": first is None,
                     "first_difference": first,
                     "infopt_margin_there": None if first is None else rec["infopt_margins"][first],
                     "llama_cpp_tokens": toks, "infopt_tokens": rec["infopt_tokens"],
                     "prompt_tokenized_alike": own == prompt, "logits_vs_infopt": agree,
                     "llama_cpp_text": llm.detokenize(toks).decode(errors="replace")}
    print(kind, "same tokens" if first is None else f"first difference at {first} (infopt margin "
          f"{results[kind]['infopt_margin_there']})", "| prompt tokenized alike:",
          results[kind]["prompt_tokenized_alike"], "| KL against infopt:",
          {k: f"{v['kl_mean']:.2e} (max {v['kl_max']:.2e}, top-1 {v['top1']:.3f})" for k, v in agree.items()},
          flush=True)
    del llm
summary = {"llama_cpp_python": llama_cpp.__version__, "threads": args.threads, "rope": doc.get("rope"),
           "family": doc.get("family", "default"), "wrong_reads_kl": doc.get("wrong_reads_kl"),
           "results": results}
if args.json:
    Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
