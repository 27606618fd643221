"""The optimisation level of an AOTInductor package's wrapper (``aot_inductor.compile_wrapper_opt_level``): what it
costs to build and what it changes in decode. The wrapper is the C++ function that calls the step's kernels in order
(about 0.9 MB of source for the default model's decode step); g++ compiles it at ``-O1`` by default, the kernels at
``-O3``.

Each side runs in processes of its own with its own empty compile caches (C++ kernels linked in as the set-up builds
them) and ``AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL`` set: first a cold process per side (``cpu-fast`` applied to the
default model, building its packages), then ``--rounds`` warm processes per side, alternating. Each process times the
apply and decodes the first built-in chat questions greedily (``_common.decode_rate``, 128 new tokens).

    python benchmarks/studies/aot_wrapper_opt.py [--levels O1,O0] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
from _common import empty_caches  # noqa: E402

CHILD = r"""
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
from _common import decode_rate
import infopt
from infopt.compile import compile_stats
from infopt.eval import CHAT_PROMPTS, chat_ids
from infopt.models import load_default
model, tok = load_default()
t0 = time.perf_counter()
infopt.optimize(model, "cpu-fast")
apply_s = time.perf_counter() - t0
rates = [decode_rate(model, chat_ids(tok, q), 128)[0] for q in CHAT_PROMPTS[:3]]
stats = compile_stats(model)
print(json.dumps({"apply_s": apply_s, "decode_tokens_per_s": statistics.median(rates), "rates": rates,
                  "aot": stats.aot, "aot_cached": stats.aot_cached, "compiles_after_warmup": stats.compiles_after_warmup}))
"""


def _run(env: dict, level: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(BENCH)], env={**env, "AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL":
                                                                       level}, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default="O1,O0")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    from infopt.core.caches import cache_dir

    levels = args.levels.split(",")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        envs = {lv: empty_caches(Path(tmp) / f"caches-{lv}", cache_dir("extensions")) for lv in levels}
        for r in range(args.rounds + 1):
            for lv in (levels if r % 2 == 0 else levels[::-1]):
                got = {**_run(envs[lv], lv), "level": lv, "cache": "cold" if r == 0 else "warm", "round": r}
                runs.append(got)
                print(json.dumps(got), flush=True)
    summary = {lv: {"cold_apply_s": next(x["apply_s"] for x in runs if x["level"] == lv and x["cache"] == "cold"),
                    "decode_tokens_per_s_median": statistics.median(x["decode_tokens_per_s"] for x in runs
                                                                    if x["level"] == lv and x["cache"] == "warm")}
               for lv in levels}
    warm = [x for x in runs if x["cache"] == "warm"]
    ratio = statistics.median(a["decode_tokens_per_s"] / b["decode_tokens_per_s"]
                              for a, b in zip([x for x in warm if x["level"] == levels[1]],
                                              [x for x in warm if x["level"] == levels[0]], strict=True))
    from infopt.bench.harness import machine_info

    result = {"summary": summary, f"decode_ratio_{levels[1]}_over_{levels[0]}": ratio, "runs": runs,
              "machine": machine_info()}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
