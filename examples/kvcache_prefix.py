"""Paged KV cache with prefix caching: a shared system prompt is computed once and reused by later calls.

Run: python examples/kvcache_prefix.py [--tiny]
(--tiny uses a small random model so it runs in seconds; the default is the embedded SmolLM2-135M.)
"""

import argparse
import time

import torch

import infopt
from infopt.eval import default_text
from infopt.kvcache import Paged, paged_pool
from infopt.models import load_default, load_default_tokenizer, tiny_model

parser = argparse.ArgumentParser()
parser.add_argument("--tiny", action="store_true")
args = parser.parse_args()

if args.tiny:
    model, tok = tiny_model("llama"), load_default_tokenizer()
else:
    model, tok = load_default()

system = "Answer from this reference:\n" + default_text(1500 if args.tiny else 4000)
questions = ["What does the with statement do?", "What is a generator?", "Explain try/except."]
prompts = [tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                   add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
           for q in questions]
plain = [model.generate(p, max_new_tokens=12, do_sample=False) for p in prompts]

infopt.optimize(model, [Paged(block_size=16)])  # switches attention to the paged backend too
seen = []
hook = model.get_input_embeddings().register_forward_pre_hook(lambda mod, a: seen.append(a[0].shape[1]))
for p, ref in zip(prompts, plain, strict=True):
    t0 = time.perf_counter()
    out = model.generate(p, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, ref), "the paged cache is lossless: greedy output equals plain generate"
    print(f"prompt {p.shape[1]} tokens: prefill ran on {seen[0]} of them, {time.perf_counter() - t0:.2f} s")
    seen.clear()
hook.remove()
print("allocator:", paged_pool(model).allocator.stats())
print(model.infopt)
