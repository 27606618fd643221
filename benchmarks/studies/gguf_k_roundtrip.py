"""Does a Q4_K_M file that llama.cpp's own quantizer wrote come back out of ``infopt.export_gguf`` with the same
weights, and does llama.cpp compute the same logits from the export as from the file?

Two steps, in two environments (llama.cpp through ``llama-cpp-python`` in its own venv, as
``benchmarks/cpu_scaling.py`` describes; that script's ``prepare`` and ``requantize`` make the Q4_K_M file)::

    .venv/bin/python benchmarks/cpu_scaling.py prepare --size llama3.2-1b --contexts 512
    /tmp/llama-venv/bin/python benchmarks/cpu_scaling.py requantize --size llama3.2-1b --file-type Q4_K_M
    .venv/bin/python benchmarks/studies/gguf_k_roundtrip.py export /tmp/infopt-scaling/llama3.2-1b-Q4_K_M.gguf \\
        /tmp/infopt-scaling/llama3.2-1b-Q4_K_M-again.gguf --json /tmp/k_export.json
    /tmp/llama-venv/bin/python benchmarks/studies/gguf_k_roundtrip.py logits \\
        /tmp/infopt-scaling/llama3.2-1b-Q4_K_M.gguf /tmp/infopt-scaling/llama3.2-1b-Q4_K_M-again.gguf \\
        --merge /tmp/k_export.json --json benchmarks/results/gguf_k_roundtrip.json

``export`` loads the file into ``cpu-fast``'s layers (``load_quantized(activations="auto")``), writes it again and
compares every tensor with the file's: the same type, the same weights (gguf's own dequantizer on both), the same
bytes. ``logits`` runs both files in llama.cpp over the same 64 token ids and compares the logits of every position.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def export(src: str, dst: str) -> dict:
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    import infopt
    from infopt.quantize.community.gguf_ckpt import _reader

    t0 = time.perf_counter()
    model, tok = infopt.load_quantized(src, activations="auto")
    loaded = time.perf_counter() - t0
    report = infopt.export_gguf(model, dst, tok if tok is not None else None)
    written = time.perf_counter() - t0 - loaded
    ours = {t.name: t for t in _reader(dst).tensors}
    kinds: dict[str, dict[str, int]] = {}
    for t in _reader(src).tensors:
        kind, again = t.tensor_type.name, ours.get(t.name)
        row = kinds.setdefault(kind, {"tensors": 0, "same_type": 0, "same_weights": 0, "same_bytes": 0})
        row["tensors"] += 1
        if again is None or again.tensor_type.name != kind:
            continue
        row["same_type"] += 1
        a, b = np.array(t.data), np.array(again.data)
        row["same_bytes"] += int(a.shape == b.shape and np.array_equal(a, b))
        va = a if kind in ("F32", "F16") else quants.dequantize(a, Q[kind])
        vb = b if kind in ("F32", "F16") else quants.dequantize(b, Q[kind])
        row["same_weights"] += int(np.array_equal(va, vb))
    return {"source": src, "export": dst, "linears": report["linears"], "exact": len(report["exact"]),
            "rounded": len(report["rounded"]), "requantized": len(report["requantized"]), "by_type": kinds,
            "load_s": loaded, "export_s": written}


def logits(src: str, dst: str, n: int = 64) -> dict:
    import random

    import llama_cpp
    import numpy as np

    rng = random.Random(0)
    out = {}
    for name, path in (("file", src), ("export", dst)):
        llm = llama_cpp.Llama(path, n_ctx=n + 8, n_threads=2, n_threads_batch=2, n_batch=n, logits_all=True,
                              verbose=False)
        ids = [rng.randrange(100, min(llm.n_vocab(), 49000)) for _ in range(n)] if not out else out["ids"]
        llm.eval(ids)
        out[name] = np.array(llm.scores[:n], dtype=np.float32)
        out["ids"] = ids
    a, b = out["file"], out["export"]
    return {"positions": n, "logits_equal": bool(np.array_equal(a, b)), "max_abs_diff": float(np.abs(a - b).max()),
            "argmax_equal": int((a.argmax(-1) == b.argmax(-1)).sum()), "llama_cpp_python": llama_cpp.__version__}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("step", choices=["export", "logits"])
    p.add_argument("source", help="a GGUF file llama.cpp's quantizer wrote")
    p.add_argument("again", help="where export writes the file again (logits: reads it)")
    p.add_argument("--merge", help="(logits) a JSON an export step wrote, to merge into the output")
    p.add_argument("--json")
    args = p.parse_args()
    got = export(args.source, args.again) if args.step == "export" else logits(args.source, args.again)
    if args.merge:
        got = {**json.loads(Path(args.merge).read_text()), "llama_cpp": got}
    text = json.dumps(got, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
