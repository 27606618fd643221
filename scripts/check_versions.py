"""A quick check of infopt on whatever torch / transformers this interpreter has (CI runs it on the oldest
transformers pyproject.toml claims, in a virtual environment of its own; see .ci/run).

It imports every subpackage, validates every preset on a tiny model, and for each tiny model family runs one
greedy generate through lossless recipes (static cache, speculative prompt lookup, paged cache + the
batching engine) and int8 weights, asserting token identity with plain ``generate`` for the lossless ones.
Exits non-zero with the failures listed. About half a minute on 2 cores.

Usage:
    python scripts/check_versions.py
"""

from __future__ import annotations

import importlib
import sys
import time
import traceback

import torch
import transformers

import infopt
from infopt.models import TINY_ARCHS, tiny_model
from infopt.recipe import PRESETS

SUBPACKAGES = ("attention", "batching", "bench", "compile", "core", "eval", "kvcache", "memory", "parallel",
               "quantize", "speculative", "testing", "io", "models", "optimize", "recipe", "cli")
LOSSLESS = {
    "static": [{"kvcache": {"kind": "static", "max_length": 64}}],
    "prompt-lookup": [{"speculative": {"method": "prompt_lookup"}}],
    "paged+batching": [{"kvcache": {"kind": "paged"}}, {"batching": {"max_seqs": 4}}],
}
CPU_PRESETS_REFUSED = {"gpu-fast"}  # CUDA graphs: refused on CPU with a clear error, which is checked too


def main() -> int:
    t0 = time.perf_counter()
    failures: list[str] = []

    def check(what: str, fn) -> None:
        try:
            fn()
        except Exception:
            failures.append(f"{what}:\n{traceback.format_exc(limit=4)}")

    for name in SUBPACKAGES:
        check(f"import infopt.{name}", lambda name=name: importlib.import_module(f"infopt.{name}"))

    def presets():
        for name in PRESETS:
            m = tiny_model("llama", hidden_size=128, num_heads=2, num_kv_heads=1)  # head_dim 64, as the presets assume
            if name in CPU_PRESETS_REFUSED and not torch.cuda.is_available():
                try:
                    infopt.validate(m, name)
                except infopt.IncompatibleModelError:
                    continue
                raise AssertionError(f"preset {name} was not refused on CPU")
            infopt.validate(m, name)

    check("preset validation", presets)

    prompt = torch.tensor([[1, 17, 400, 23, 9, 1200, 5, 17, 400, 23]])
    kw = dict(max_new_tokens=12, do_sample=False)
    for arch in TINY_ARCHS:
        def family(arch=arch):
            ref = tiny_model(arch).generate(prompt, **kw)
            for label, steps in LOSSLESS.items():
                m = tiny_model(arch)
                infopt.optimize(m, {"steps": steps})
                out = m.generate(prompt, **kw)
                if not torch.equal(out, ref):
                    raise AssertionError(f"{label}: greedy output differs from plain generate")
            m = tiny_model(arch)
            infopt.optimize(m, {"steps": [{"quantize": {"method": "int8"}}]})
            if m.generate(prompt, **kw).shape != ref.shape:
                raise AssertionError("int8: output shape differs")

        check(f"tiny {arch}", family)

    took = time.perf_counter() - t0
    print(f"infopt {infopt.__version__} on torch {torch.__version__}, transformers {transformers.__version__}: "
          f"{len(failures)} failure(s) in {took:.0f} s")
    for f in failures:
        print(f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
