"""Optimize a model in place, use it with generate and pipeline, read the report, undo.

Run: python examples/quickstart.py [--tiny]
(--tiny uses a small random model so it runs in seconds; the default is the embedded SmolLM2-135M.)
"""

import argparse

import torch
from transformers import pipeline

import infopt
from infopt.models import load_default, load_default_tokenizer, tiny_model

parser = argparse.ArgumentParser()
parser.add_argument("--tiny", action="store_true")
args = parser.parse_args()

if args.tiny:
    model, tok = tiny_model("llama"), load_default_tokenizer()
else:
    model, tok = load_default()

prompt = tok("The three rules of clean code are", return_tensors="pt")["input_ids"]
before = model.generate(prompt, max_new_tokens=16, do_sample=False)

infopt.optimize(model, [
    infopt.attention.Attention("sdpa"),
    infopt.quantize.Int8WeightOnly(),
    infopt.kvcache.Static(max_length=256),
])
print(model.infopt)

pipe = pipeline("text-generation", model=model, tokenizer=tok)
print(pipe("The three rules of clean code are", max_new_tokens=16, do_sample=False)[0]["generated_text"])

infopt.undo(model)
after = model.generate(prompt, max_new_tokens=16, do_sample=False)
assert torch.equal(before, after), "undo must restore the original model"
print("undo restored the original model: greedy output identical")
