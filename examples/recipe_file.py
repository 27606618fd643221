"""Apply a YAML recipe with a quality gate, then save and reload the optimized model.

Run: python examples/recipe_file.py [--tiny]
"""

import argparse
import tempfile
from pathlib import Path

import torch

import infopt
from infopt.io import load_optimized, save_optimized
from infopt.models import load_default, load_default_tokenizer, tiny_model

parser = argparse.ArgumentParser()
parser.add_argument("--tiny", action="store_true")
args = parser.parse_args()
model, tok = (tiny_model("llama"), load_default_tokenizer()) if args.tiny else load_default()

recipe = Path(__file__).with_name("recipe.yaml")
try:
    infopt.optimize(model, str(recipe))
except infopt.QualityGateError as e:
    print("gate failed:", e.figures)
    raise
print(model.infopt)

with tempfile.TemporaryDirectory() as d:
    save_optimized(model, d, tokenizer=tok)
    reloaded, _ = load_optimized(d)
    ids = tok("Hello", return_tensors="pt")["input_ids"]
    assert torch.equal(reloaded(ids).logits, model(ids).logits)
    print("saved and reloaded: identical logits")
