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


SAVE_METADATA = frozenset({"architectures", "transformers_version", "_name_or_path", "_commit_hash"})
"""Config fields that describe a checkpoint and that no forward reads: ``save_pretrained`` fills in
``architectures`` (a model built from a config has none), so they are left out of :func:`module_signature`."""


def _config_value(key: str, value: Any) -> str:
    if key in ("dtype", "torch_dtype"):  # save_pretrained turns torch.float32 into "float32" on the live config
        return str(value).removeprefix("torch.")
    return repr(value)


def module_signature(model: nn.Module) -> int:
    """A hash of what dynamo's module guards check, computed in one pass: each parameter's and buffer's identity,
    dtype, device, shape and grad flag, each module's training flag and hooks, the config's values (but for the
    checkpoint metadata that ``save_pretrained`` writes into it, :data:`SAVE_METADATA`, and the dtype's spelling).

    Example:
        >>> from infopt.models import tiny_model
        >>> m = tiny_model()
        >>> before = module_signature(m)
        >>> m.config.architectures, m.config.dtype = ["LlamaForCausalLM"], "float32"  # what a save writes
        >>> module_signature(m) == before
        True
        >>> m.config.rms_norm_eps = 1e-3
        >>> module_signature(m) == before
        False
    """
    parts: list = []
    for m in model.modules():
        parts.append((m.training, len(m._forward_hooks), len(m._forward_pre_hooks), "forward" in m.__dict__))
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None:
                parts.append((id(t), t.dtype, t.device, tuple(t.shape), t.requires_grad))
    config = getattr(model, "config", None)
    if config is not None:
        parts.append(repr(sorted((k, _config_value(k, v)) for k, v in vars(config).items() if k not in SAVE_METADATA)))
    return hash(tuple(parts))
