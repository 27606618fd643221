"""Quantize to int4, measure the quality cost against the original, save with save_pretrained, reload with infopt.load.

Run: python examples/quantize_int4.py [--tiny]
(--tiny uses a small random model so it runs in seconds; the default is the embedded SmolLM2-135M.)
"""

import argparse
import tempfile

import torch

import infopt
from infopt.eval import evaluate, make_reference
from infopt.models import load_default, load_default_tokenizer, tiny_model
from infopt.quantize import Int4WeightOnly

parser = argparse.ArgumentParser()
parser.add_argument("--tiny", action="store_true")
args = parser.parse_args()

if args.tiny:
    model, tok = tiny_model("llama"), load_default_tokenizer()
else:
    model, tok = load_default()

reference = make_reference(model, tokenizer=tok, max_tokens=256)  # the original's log-probs, kept in memory
# group_size 32 divides the default model's 576 channels (128 does not); the tied head gets an int8 copy
infopt.optimize(model, [Int4WeightOnly(group_size=32, include_lm_head=True)])
print(model.infopt)
print(evaluate(model, reference))

prompt = tok("The three rules of clean code are", return_tensors="pt")["input_ids"]
out = model.generate(prompt, max_new_tokens=16, do_sample=False)
print(tok.decode(out[0, prompt.shape[1]:]))

with tempfile.TemporaryDirectory() as d:
    model.save_pretrained(d)  # an optimized model also writes its recipe next to the weights
    reloaded, _ = infopt.load(d)
    assert torch.equal(reloaded(prompt).logits, model(prompt).logits), "reload must give identical outputs"
print("saved with save_pretrained and reloaded with infopt.load: identical logits")
