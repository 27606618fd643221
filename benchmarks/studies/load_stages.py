"""Where a process's time to its first token goes when it loads a GGUF file into ``cpu-fast``'s layers: the time
since the process started at the end of each stage (imports, ``load_quantized``, the rest of ``cpu-fast`` from the
compile cache, a first and a second 4-token ``generate``), one line each, with the resident set then.

Usage: python benchmarks/studies/load_stages.py SIZE [--workdir /tmp/infopt-scaling] [--max-length 4608]
[--file-type Q4_0-llama] [--no-mmap] [--dense-embedding] [--imports-first]

``--no-mmap`` loads with ``load_quantized(mmap=False)`` (large dense tensors copied, not mapped);
``--dense-embedding`` decodes an untied quantized token embedding dense (the loader before ``BlockEmbedding``):
each against the default, for A/B runs. ``--imports-first`` imports the transformers code ``load_quantized`` would
import (its model classes, its GGUF tables) as a stage of its own before it, so the ``load_quantized`` stage is the
file's own work: what any library built on torch and transformers pays before it reads a weight, apart from what
infopt adds.

SIZE names a file ``benchmarks/cpu_scaling.py prepare`` wrote (``SIZE.gguf`` and ``SIZE.prompts.json`` in the work
folder). Run it twice: the first run may build the compile step's package. Run on a quiet machine.
"""

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402


def stage(name: str) -> None:
    rss = next((int(line.split()[1]) // 1024 for line in open("/proc/self/status") if line.startswith("VmRSS:")), -1)
    print(f"{time.perf_counter() - T0:7.2f} s  {rss:6d} MB  {name}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("size")
    p.add_argument("--workdir", default="/tmp/infopt-scaling")
    p.add_argument("--max-length", type=int, default=4608)
    p.add_argument("--file-type", default="Q4_0", help="Q4_0: SIZE.gguf; another: SIZE.FILE_TYPE.gguf")
    p.add_argument("--no-mmap", action="store_true")
    p.add_argument("--dense-embedding", action="store_true")
    p.add_argument("--imports-first", action="store_true")
    args = p.parse_args()
    import torch
    stage("import torch")
    import transformers  # noqa: F401
    stage("import transformers")
    import infopt
    stage("import infopt")
    work = Path(args.workdir)
    if args.dense_embedding:
        from infopt.quantize.community import gguf_ckpt

        gguf_ckpt._block_embedding = lambda *a: None
    suffix = "" if args.file_type == "Q4_0" else f".{args.file_type}"
    if args.imports_first:
        import importlib

        from infopt.models import _real_size_config

        kind = _real_size_config(args.size).model_type  # e.g. "llama", "qwen2", "gemma3_text"
        package = kind.removesuffix("_text")
        for name in ("transformers.modeling_utils", "transformers.modeling_gguf_pytorch_utils",
                     f"transformers.models.{package}.configuration_{package}",
                     f"transformers.models.{package}.modeling_{package}"):
            importlib.import_module(name)
        stage(f"import transformers' {package} model classes and GGUF tables")
    model, _ = infopt.load_quantized(work / f"{args.size}{suffix}.gguf", activations="auto", tokenizer=False,
                                     mmap=not args.no_mmap)
    stage("load_quantized")
    torch.set_num_threads(2)
    infopt.optimize(model, [{"kvcache": {"kind": "static", "max_length": args.max_length, "dtype": "float16"}},
                            {"compile": {"mode": "default", "aot": "auto", "warmup_batch_sizes": [1]}}])
    stage("optimize (static cache, compile step)")
    ids = torch.tensor([json.loads((work / f"{args.size}.prompts.json").read_text())["tg"]])
    for name in ("generate, 4 tokens (the first token)", "generate, 4 tokens again"):
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        stage(name)


if __name__ == "__main__":
    main()
