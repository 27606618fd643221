"""What common ``generate`` options cost on an optimized model, and which loop serves them: the default model with a
recipe (``cpu-fast`` by default), a 20-token chat answer timed plain and with ``repetition_penalty``, a stop string
(with the tokenizer) and ``return_dict_in_generate`` + ``output_scores``, in alternating rounds; the medians, the
loops that served the calls (``model.infopt.routing``), and whether each option's tokens are the plain call's (a
penalty changes them by design; a stop string that never matches and asking for scores must not).

    python benchmarks/studies/generate_options.py [--recipe cpu-fast] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="cpu-fast")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()

    import infopt
    from infopt.bench.harness import machine_info
    from infopt.models import load_default

    model, tok = load_default()
    infopt.optimize(model, args.recipe)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    base = dict(**ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    options = {
        "plain": {},
        "repetition_penalty=1.3": {"repetition_penalty": 1.3},
        "stop_strings (never matching)": {"stop_strings": ["zzz-not-there"], "tokenizer": tok},
        "return_dict_in_generate + output_scores": {"return_dict_in_generate": True, "output_scores": True},
    }
    seconds: dict[str, list[float]] = {k: [] for k in options}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for name, kw in options.items():
            t = time.perf_counter()
            out = model.generate(**base, **kw)
            seconds[name].append(time.perf_counter() - t)
            tokens[name] = getattr(out, "sequences", out)[0].tolist()
    rows = {name: {"median_s": statistics.median(s), "seconds": s, "same_tokens_as_plain": tokens[name] == tokens["plain"]}
            for name, s in seconds.items()}
    for name, r in rows.items():
        print(f"{name:42s} {r['median_s']:.3f} s  same tokens as plain: {r['same_tokens_as_plain']}")
    routing = model.infopt.routing
    print(routing)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": machine_info(), "recipe": args.recipe, "rounds": args.rounds, "options": rows,
            "routing": routing,
            "command": f"python benchmarks/studies/generate_options.py --recipe {args.recipe} --rounds {args.rounds}",
        }, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
