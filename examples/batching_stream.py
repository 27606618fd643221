"""Continuous batching in a notebook or script: several prompts decode together, tokens stream as they come.

    python examples/batching_stream.py           # the embedded default model
    python examples/batching_stream.py --tiny    # a tiny random model (fast, for tests)
"""

from __future__ import annotations

import argparse
import threading

import infopt
from infopt.batching import Batching, Engine, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    if args.tiny:
        from infopt.models import load_default_tokenizer, tiny_model

        model, tok = tiny_model(), load_default_tokenizer()
    else:
        from infopt.models import load_default

        model, tok = load_default()

    def chat(text: str) -> str:
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)

    # 1) the engine directly: submit, stream one request while the others decode in the same steps
    engine = Engine(model, tok, max_seqs=8, max_batch_tokens=256)
    questions = ["What is a KV cache?", "Name three prime numbers.", "Write a haiku about batching."]
    greedy = SamplingParams(max_new_tokens=24)
    with engine:  # a background thread drives the engine
        handles = [engine.submit(chat(q), greedy) for q in questions]
        printer = threading.Thread(target=lambda: [print(piece, end="", flush=True)
                                                   for piece in handles[0].stream(text=True)])
        printer.start()
        printer.join()
        print()
        for q, h in zip(questions, handles, strict=True):
            out = h.result()
            m = out.metrics
            print(f"- {q!r}: {len(out.token_ids)} tokens, finish {out.finish_reason}, "
                  f"TTFT {1e3 * m.ttft:.0f} ms, TPOT {1e3 * (m.tpot or 0):.0f} ms")
    print("engine:", {k: v for k, v in engine.metrics().items() if k in ("steps", "prefill_tokens", "decode_tokens",
                                                                          "preemptions", "kv_util_max")})

    # 2) the recipe step: a padded generate (or a pipeline with batch_size) runs through an engine
    infopt.undo(model)
    infopt.optimize(model, [Batching(max_seqs=8)], tokenizer=tok)
    tok.padding_side = "left"
    batch = tok([chat(q) for q in questions], return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=12, do_sample=False)
    for row in tok.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True):
        print("generate:", repr(row))
    print(model.infopt)
    infopt.undo(model)


if __name__ == "__main__":
    main()
