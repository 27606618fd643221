"""What quality `cpu-fast` gives up, knob by knob, on the default model: KL, top-1, perplexity and chat answers.

Each row is `cpu-fast`'s quantize step with one knob changed (activations, group size, head, weight bits), applied to
a fresh copy of the fp32 default model, measured against the fp32 model: KL and top-1 over the first 1,024 tokens of
:func:`infopt.eval.default_text` (:func:`infopt.eval.compare`), and the greedy answers to the eight built-in chat
questions (:func:`infopt.eval.answer_agreement`, 32 tokens each), with the original's top-2 margin where an answer
parted. Quality only: no compile step (it changes no number here), so rows take seconds; decode speed is in the
other results files.

Usage: python benchmarks/quality_knobs.py [--out benchmarks/results/quality-knobs.json]
"""

import argparse
import copy
import json
import platform
import time
from pathlib import Path

import torch
import transformers

import infopt
from infopt.eval import answer_agreement, compare, reference_answers, reference_logits
from infopt.models import load_default

HERE = Path(__file__).resolve().parent
CPU_FAST = {"method": "int4", "group_size": 32, "include_lm_head": True, "share_embedding": True, "activations": "auto"}
ROWS = {
    "cpu-fast (int4 g32, int8 head, int8 activations where the CPU has VNNI/AVX2)": CPU_FAST,
    "activations: float": {**CPU_FAST, "activations": "float"},
    "group_size: 64": {**CPU_FAST, "group_size": 64},
    "head in fp32 (include_lm_head: false)": {**CPU_FAST, "include_lm_head": False, "share_embedding": False},
    "int8 weights (method: int8, int8 head)": {"method": "int8", "include_lm_head": True},
}

p = argparse.ArgumentParser()
p.add_argument("--out", type=Path, default=HERE / "results" / "quality-knobs.json")
p.add_argument("--max-tokens", type=int, default=1024)
args = p.parse_args()

base, tok = load_default()
t0 = time.perf_counter()
ref = reference_logits(base, tokenizer=tok, max_tokens=args.max_tokens)
answers = reference_answers(base, tok)
print(f"reference in {time.perf_counter() - t0:.0f} s", flush=True)
rows = []
for label, step in ROWS.items():
    m = copy.deepcopy(base)
    infopt.optimize(m, [{"quantize": step}])
    q = compare(m, ref)
    agree = answer_agreement(m, tok, answers)
    row = {"row": label, "quantize": step, "kl": q["kl"], "top1": q["top1"], "ppl": q["ppl"], "ppl_ref": q["ppl_ref"],
           "tokens": q["tokens"], "weights_mib": m.infopt.memory_after / 2**20, "answers_same": agree.same,
           "answers_total": agree.total, "parted_at": agree.parted_at, "margins": agree.margins}
    rows.append(row)
    print(f"{label:<80} KL {q['kl']:.4f} top-1 {q['top1']:.3f} ppl {q['ppl']:.2f} ({q['ppl_ref']:.2f}) "
          f"weights {row['weights_mib']:.1f} MiB; {agree}", flush=True)
    del m
result = {"machine": {"cpu": platform.processor() or platform.machine(),
                      "capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
                      "transformers": transformers.__version__, "infopt": infopt.__version__},
          "model": "SmolLM2-135M-Instruct (fp32 reference)", "rows": rows,
          "command": "python benchmarks/quality_knobs.py"}
args.out.write_text(json.dumps(result, indent=1) + "\n")
