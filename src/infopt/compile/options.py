"""What every compiled forward of :mod:`infopt.compile` sets and checks: Inductor's options for a compile mode, and
the one-pass signature of what dynamo's module guards would check (compared per call where those guards are
skipped)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["mode_options", "module_signature"]


def mode_options(mode: str, device: torch.device, cpp_wrapper: bool, size_asserts: bool | None = None
                 ) -> dict[str, Any]:
    """Inductor config for a compile ``mode`` on ``device``.

    ``reduce-overhead`` is CUDA graphs; ``max-autotune`` also benchmarks kernel choices (on CPU, C++
    GEMM templates, including the weight-only int8/int4 ones, against the ATen kernels). CUDA graphs
    are dropped off CUDA, where they do not apply. ``size_asserts`` sets Inductor's checks of every input's and
    every operator output's size and stride in the generated code (None: Inductor's default).

    Example:
        >>> "triton.cudagraphs" in mode_options("reduce-overhead", torch.device("cpu"), False)
        False
    """
    from torch._inductor import list_mode_options

    opts = dict(list_mode_options(mode))
    if device.type != "cuda":
        opts.pop("triton.cudagraphs", None)
    if cpp_wrapper:
        opts["cpp_wrapper"] = True
    if size_asserts is not None:
        opts["size_asserts"] = size_asserts
    from .passes import FuseSharedInputLinears

    if FuseSharedInputLinears is not None:  # int8-activation linears on one input: one call (see .passes)
        opts["post_grad_custom_post_pass"] = FuseSharedInputLinears()
    return opts


def module_signature(model: nn.Module) -> int:
    """A hash of what dynamo's module guards check, computed in one pass: each parameter's and buffer's identity,
    dtype, device, shape and grad flag, each module's training flag and hooks, the config's values."""
    parts: list = []
    for m in model.modules():
        parts.append((m.training, len(m._forward_hooks), len(m._forward_pre_hooks), "forward" in m.__dict__))
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None:
                parts.append((id(t), t.dtype, t.device, tuple(t.shape), t.requires_grad))
    config = getattr(model, "config", None)
    if config is not None:
        parts.append(repr(sorted((k, repr(v)) for k, v in vars(config).items())))
    return hash(tuple(parts))
