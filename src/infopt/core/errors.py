"""Named exceptions raised by infopt; every message names what was wrong and how to fix it."""

from __future__ import annotations

__all__ = [
    "InfoptError",
    "RecipeError",
    "IncompatibleModelError",
    "MissingBackendError",
    "QualityGateError",
    "CheckpointError",
]


class InfoptError(Exception):
    """Base class of every error infopt raises on purpose."""


class RecipeError(InfoptError, ValueError):
    """A recipe (or a step config in it) is malformed, contradictory or cannot be applied.

    Raised by :func:`infopt.optimize` *before* the model is touched.
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
