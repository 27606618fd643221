"""Compile the forward pass with ``torch.compile``; the instance's ``forward`` is replaced, the class untouched."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..core.errors import IncompatibleModelError
from ..core.patch import wrap_method
from ..core.step import ApplyContext, StepConfig, bad_field, register_step, register_transform

__all__ = ["Compile", "compile_"]

_MODES = ("default", "reduce-overhead", "max-autotune")


@register_step
@dataclass(frozen=True)
class Compile(StepConfig):
    """``torch.compile`` the model's forward.

    Needs a static-shape KV cache (``kvcache.Static``): with a growing cache every decode step has
    a new shape and would recompile. ``reduce-overhead`` (CUDA graphs) needs a CUDA model.

    Args:
        mode: ``default``, ``reduce-overhead`` or ``max-autotune``.
        fullgraph: fail on graph breaks instead of splitting the graph.
        dynamic: let the compiler generalise over shapes.
        backend: torch.compile backend (``inductor``; ``eager`` for debugging).

    Example:
        >>> Compile(mode="default").to_dict()
        {'compile': {'mode': 'default', 'fullgraph': False, 'dynamic': False, 'backend': 'inductor'}}
    """

    stage: ClassVar[str] = "compile"
    mode: str = "default"
    fullgraph: bool = False
    dynamic: bool = False
    backend: str = "inductor"

    def __post_init__(self):
        if self.mode not in _MODES:
            raise bad_field(self, "mode", self.mode, ", ".join(_MODES))
        if self.backend not in ("inductor", "eager", "aot_eager"):
            raise bad_field(self, "backend", self.backend, "inductor, eager, aot_eager")

    def check(self, model, info, steps):
        if self.mode == "reduce-overhead" and info.device.type != "cuda":
            raise IncompatibleModelError(
                f"compile mode 'reduce-overhead' uses CUDA graphs; the model is on {info.device}. Use mode 'default'"
            )
        return []


def compile_(model: nn.Module, config: Compile, *, step: str | None = None) -> nn.Module:
    """Replace ``model.forward`` on the instance with its compiled version (undo restores it).

    Returns:
        The same model.
    """

    def make(original):
        return torch.compile(original, mode=None if config.mode == "default" else config.mode,
                             fullgraph=config.fullgraph, dynamic=config.dynamic, backend=config.backend)

    wrap_method(model, "forward", make, step=step or config.key)
    return model


@register_transform(Compile)
def _apply(model: nn.Module, config: Compile, ctx: ApplyContext) -> None:
    compile_(model, config)
    ctx.notes.append(f"forward compiled lazily (mode={config.mode}, backend={config.backend}); the first calls compile")
