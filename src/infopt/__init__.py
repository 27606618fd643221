"""infopt: composable, in-place inference optimizations for Hugging Face transformers causal LMs.

Example:
    >>> import infopt
    >>> from infopt.models import tiny_model
    >>> model = infopt.optimize(tiny_model(), "cpu-lossless")
    >>> infopt.undo(model) > 0
    True
"""

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
from .quantize.community import load_quantized
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
