"""Where a fresh process's time goes from start to the first token: ``cpu-fast``'s layers loaded from a GGUF file.

Imports (torch, infopt, transformers' model code), ``load_quantized(activations="auto")``, the rest of ``cpu-fast``
(static cache + compile from a warm cache: run it twice, the first fills the cache) and one generated token.
Measured with the ``cpu_scaling.py`` export of Qwen2.5-0.5B's shapes (``cpu_scaling.py prepare --size qwen2.5-0.5b``);
on the 2-core AVX2 machine, 2026-11-29: torch 1.9 s, infopt 1.5 s, transformers' model code 3.1 s, load 5.4 s before
the header walk stepped over the vocabulary (and the codes became bytes), 2.0 s after, optimize 0.9 s, first token
0.2 s.

    python benchmarks/studies/gguf_start.py /tmp/infopt-scaling/qwen2.5-0.5b.gguf
"""

import time

T0 = time.perf_counter()
import sys  # noqa: E402

import torch  # noqa: E402

T1 = time.perf_counter()
import infopt  # noqa: E402

T2 = time.perf_counter()
import transformers.models.qwen2.modeling_qwen2  # noqa: E402, F401

T3 = time.perf_counter()
model, _ = infopt.load_quantized(sys.argv[1], activations="auto", tokenizer=False)
torch.set_num_threads(2)
T4 = time.perf_counter()
infopt.optimize(model, [{"kvcache": {"kind": "static", "max_length": 4608}},
                        {"compile": {"mode": "default", "aot": "auto", "warmup_batch_sizes": [1]}}])
T5 = time.perf_counter()
model.generate(torch.arange(100, 132)[None], max_new_tokens=1, do_sample=False, pad_token_id=0)
T6 = time.perf_counter()
print(f"torch {T1 - T0:.2f} s, infopt {T2 - T1:.2f} s, model code {T3 - T2:.2f} s, load {T4 - T3:.2f} s, "
      f"optimize {T5 - T4:.2f} s, first token {T6 - T5:.2f} s, total {T6 - T0:.2f} s")
