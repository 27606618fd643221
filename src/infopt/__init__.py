"""infopt: composable, in-place inference optimizations for Hugging Face transformers causal LMs.

Example:
    >>> import infopt
    >>> from infopt.models import tiny_model
    >>> model = infopt.optimize(tiny_model(), "cpu-lossless")
    >>> infopt.undo(model) > 0
    True
"""

import difflib
import importlib

from . import attention, batching, compile, kvcache, parallel, quantize, speculative
from ._version import __version__
from .core.errors import (
    CheckpointError,
    IncompatibleModelError,
    InfoptError,
    MissingBackendError,
    QualityGateError,
    RecipeError,
)
from .io import load, save_optimized
from .optimize import OptimizationReport, explain, optimize, undo, validate
from .quantize.community import export_gguf, load_quantized
from .recipe import PRESETS, Recipe
from .tuner import TuneResult, tune

__all__ = [
    "__version__",
    "optimize",
    "undo",
    "validate",
    "explain",
    "tune",
    "TuneResult",
    "load",
    "save_optimized",
    "load_quantized",
    "export_gguf",
    "Recipe",
    "PRESETS",
    "OptimizationReport",
    "InfoptError",
    "RecipeError",
    "IncompatibleModelError",
    "MissingBackendError",
    "QualityGateError",
    "CheckpointError",
    "attention",
    "batching",
    "compile",
    "kvcache",
    "parallel",
    "quantize",
    "speculative",
]

# the measurement packages (quality, benchmarks, memory estimates, the demo, the pytest plugin's helpers) cost import
# time that optimizing does not need: ``infopt.eval`` and the others load on first use
_ON_FIRST_USE = ("eval", "bench", "memory", "demo", "testing")  # the others load with infopt


# names a user reaches for that infopt spells otherwise
_SPELT_OTHERWISE = {"save": "infopt.save_optimized(model, folder) or model.save_pretrained(folder) (infopt.load "
                            "reads either)"}


def __getattr__(name: str):
    if name in _ON_FIRST_USE:
        return importlib.import_module(f".{name}", __name__)
    hint = _SPELT_OTHERWISE.get(name)
    if hint is None:
        close = difflib.get_close_matches(name, [*__all__, *_ON_FIRST_USE], n=2)
        hint = " or ".join(f"infopt.{c}" for c in close) if close else None
    raise AttributeError(f"module 'infopt' has no attribute {name!r}" + (f"; did you mean {hint}?" if hint else ""))
