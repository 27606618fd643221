"""Named exceptions raised by infopt; every message names what was wrong and how to fix it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "InfoptError",
    "RecipeError",
    "UnknownFieldError",
    "IncompatibleModelError",
    "MissingBackendError",
    "QualityGateError",
    "CheckpointError",
    "did_you_mean",
]


def did_you_mean(value: object, options: Iterable[object]) -> str:
    """``" Did you mean 'x'?"`` for the option closest to a misspelt ``value`` (case-insensitive), else ``""``.

    Args:
        value: what the user wrote (only strings get a suggestion).
        options: the names allowed there.

    Returns:
        The sentence, with a leading space, ready to append to a message; empty when nothing is close.

    Example:
        >>> did_you_mean("cpu_fast", ["cpu-fast", "gpu-fast", "memory-saver"])
        " Did you mean 'cpu-fast'?"
        >>> did_you_mean("int3", ["int8", "int4", "gptq"])
        " Did you mean 'int4' or 'int8'?"
        >>> did_you_mean("zzz", ["int8", "int4"])
        ''
    """
    if not isinstance(value, str) or not value:
        return ""
    names = {str(o).lower(): str(o) for o in options if o is not None and str(o)}
    if value.lower() in names and names[value.lower()] != value:  # only the case differs
        return f" Did you mean {names[value.lower()]!r}?"
    close = difflib.get_close_matches(value.lower(), list(names), n=3, cutoff=0.6)
    if not close or names[close[0]] == value:
        return ""

    def score(name: str) -> float:
        return difflib.SequenceMatcher(None, value.lower(), name).ratio()

    best = [n for n in close if score(n) == score(close[0])]  # a tie ('int3': int4, int8) names each
    return " Did you mean " + " or ".join(repr(names[n]) for n in sorted(best)) + "?"


class InfoptError(Exception):
    """Base class of every error infopt raises on purpose."""


class RecipeError(InfoptError, ValueError):
    """A recipe (or a step config in it) is malformed, contradictory or cannot be applied.

    Raised by :func:`infopt.optimize` *before* the model is touched.
    """


class UnknownFieldError(RecipeError, TypeError):
    """A step config was given a field it does not have (``kvcache.Static(max_len=128)``), with a "did you mean".

    Raised alike by a config's constructor and by a recipe mapping (``{"kvcache": {"kind": "static",
    "max_len": 128}}``). It is a :class:`RecipeError`, like every recipe mistake, and a ``TypeError``, which is
    what Python raises for an unexpected keyword argument, so code catching either keeps working.
    """


class IncompatibleModelError(InfoptError, ValueError):
    """The model (architecture, dtype, device, state) does not support a step."""


class CheckpointError(InfoptError, ValueError):
    """A saved model cannot be rebuilt as it was saved: a quantized layer of an unknown kind, or tensors missing,
    mis-shaped or of the wrong dtype in its files. Raised instead of returning a partly initialised model."""


class MissingBackendError(InfoptError, ImportError):
    """An optional backend package is not installed.

    The message names the ``pip install 'infopt[extra]'`` command that provides it.
    """

    def __init__(self, message: str, *, package: str | None = None, extra: str | None = None):
        super().__init__(message)
        self.package = package
        self.extra = extra


class QualityGateError(InfoptError):
    """An optimized model failed the quality gate of its recipe.

    The model stays optimized; ``err.figures`` holds the measured values so the caller can
    decide to accept them or call :func:`infopt.undo`.
    """

    def __init__(self, message: str, *, figures: dict | None = None):
        super().__init__(message)
        self.figures = dict(figures or {})
