"""Save an optimized model with its recipe, and load it back optimized (quantized weights included)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .optimize import optimize
from .recipe import Recipe

__all__ = ["save_optimized", "load_optimized", "RECIPE_FILE", "WEIGHTS_FILE"]

RECIPE_FILE = "infopt_recipe.yaml"
WEIGHTS_FILE = "infopt_model.safetensors"


def save_optimized(model: nn.Module, directory: str | Path, tokenizer=None) -> Path:
    """Write an optimized model so :func:`load_optimized` restores it exactly.

    The folder holds the HF ``config.json`` (and ``generation_config.json``), the tokenizer if
    given, the recipe as ``infopt_recipe.yaml``, and the model's state dict *as optimized*
    (int8 weights stay int8) in ``infopt_model.safetensors``.

    Raises:
        ValueError: the model was not optimized with :func:`infopt.optimize`.
    """
    from safetensors.torch import save_model

    report = model.__dict__.get("infopt")
    if report is None:
        raise ValueError("save_optimized needs a model optimized with infopt.optimize(); use save_pretrained otherwise")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    recipe = Recipe(report.applied_steps())
    (out / RECIPE_FILE).write_text(recipe.to_yaml())
    save_model(model, str(out / WEIGHTS_FILE))
    (out / "infopt_meta.json").write_text(json.dumps({"dtype": str(next(model.parameters()).dtype)}))
    return out


def load_optimized(directory: str | Path, *, device: str | torch.device = "cpu"):
    """Load what :func:`save_optimized` wrote: ``(model, tokenizer_or_None)``, optimized, same outputs.

    The model is built from its config, the recipe re-applied (which creates the quantized
    modules), then the saved state dict loaded over it, strictly.
    """
    from safetensors.torch import load_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    d = Path(directory)
    if not (d / RECIPE_FILE).is_file():
        raise FileNotFoundError(f"{d} has no {RECIPE_FILE}; it was not written by infopt.save_optimized")
    config = AutoConfig.from_pretrained(str(d), local_files_only=True)
    meta = json.loads((d / "infopt_meta.json").read_text())
    dtype = getattr(torch, meta["dtype"].replace("torch.", ""))
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    if (d / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(d), local_files_only=True)
    optimize(model, Recipe.from_yaml((d / RECIPE_FILE).read_text()), rebuild=True)
    load_model(model, str(d / WEIGHTS_FILE), strict=True, device=str(device))
    tok = None
    if (d / "tokenizer_config.json").is_file():
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    return model, tok
