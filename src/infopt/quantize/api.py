"""``quantize_``: the one verb that applies any quantization config to a model's linear layers."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable

from torch import nn

from ..core.errors import IncompatibleModelError, RecipeError
from ..core.introspect import inspect_model, param_bytes
from ..core.patch import swap_module
from ..core.step import ApplyContext, StepConfig, register_transform
from .int8 import Int8Linear, Int8WeightOnly

__all__ = ["quantize_", "QUANTIZERS"]

# config type -> function(module, config, conv1d) -> replacement module
QUANTIZERS: dict[type[StepConfig], Callable[[nn.Module, StepConfig, bool], nn.Module]] = {
    Int8WeightOnly: lambda mod, cfg, conv1d: Int8Linear.from_float(mod, compute_dtype=cfg.compute_dtype, conv1d=conv1d),
}


def _targets(model: nn.Module, config: StepConfig, filter_fn, include, exclude) -> list[tuple[str, nn.Module, bool]]:
    info = inspect_model(model)
    names = list(info.attn_linear_fqns) + list(info.mlp_linear_fqns)
    if getattr(config, "include_lm_head", False) and not info.tied_embeddings:
        names.append(info.lm_head_fqn)
    out = []
    for fqn in names:
        mod = model.get_submodule(fqn)
        if include and not any(fnmatch.fnmatchcase(fqn, pat) for pat in include):
            continue
        if exclude and any(fnmatch.fnmatchcase(fqn, pat) for pat in exclude):
            continue
        if filter_fn is not None and not filter_fn(mod, fqn):
            continue
        is_conv1d = type(mod).__name__ == "Conv1D"
        if not isinstance(mod, nn.Linear) and not is_conv1d:
            continue  # already swapped, or a layer type this config does not handle
        out.append((fqn, mod, is_conv1d))
    return out


def quantize_(
    model: nn.Module,
    config: StepConfig,
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    include: list[str] | tuple[str, ...] | None = None,
    exclude: list[str] | tuple[str, ...] | None = None,
    keep_original: str = "disk",
    step: str | None = None,
) -> nn.Module:
    """Quantize the attention and MLP projections of ``model`` in place.

    Args:
        model: a transformers causal LM (see :data:`infopt.core.introspect.SUPPORTED_MODEL_TYPES`).
        config: a quantization config such as :class:`Int8WeightOnly`.
        filter_fn: ``filter_fn(module, fqn) -> bool`` picks the layers to quantize.
        include / exclude: glob patterns on the layer's dotted name (``"*.mlp.*"``).
        keep_original: ``"disk"`` (default) moves the original weights to a temporary file so their
            memory is freed while :func:`infopt.undo` can still restore them bit for bit;
            ``"memory"`` keeps them in RAM (faster undo, no memory saved).

    Returns:
        The same model.

    Raises:
        RecipeError: ``config`` is not a quantization config.
        IncompatibleModelError: the model's architecture is not supported, or nothing matched.

    Example:
        >>> from infopt.models import tiny_model
        >>> m = quantize_(tiny_model(), Int8WeightOnly(), include=["*.mlp.*"])
        >>> type(m.model.layers[0].self_attn.q_proj).__name__, type(m.model.layers[0].mlp.up_proj).__name__
        ('Linear', 'Int8Linear')
    """
    make = QUANTIZERS.get(type(config))
    if make is None:
        raise RecipeError(
            f"quantize_ got {type(config).__name__}; expected one of: {', '.join(c.__name__ for c in QUANTIZERS)}"
        )
    targets = _targets(model, config, filter_fn, include, exclude)
    if not targets:
        raise IncompatibleModelError(
            f"quantize_({type(config).__name__}) found no linear layer to quantize; check include/exclude/filter_fn, "
            "or whether the model is already quantized"
        )
    # build every replacement first, so a failure leaves the model untouched
    replacements = [(fqn, make(mod, config, conv1d)) for fqn, mod, conv1d in targets]
    for fqn, new in replacements:
        swap_module(model, fqn, new, step=step or config.key, keep_original=keep_original)
    return model


@register_transform(Int8WeightOnly)
def _apply(model: nn.Module, config: StepConfig, ctx: ApplyContext) -> None:
    before = param_bytes(model)
    n = len(_targets(model, config, None, None, None))
    quantize_(model, config)
    after = param_bytes(model)
    ctx.stats["modules_quantized"] = n
    ctx.notes.append(f"{n} linear layers -> {type(config).__name__}; weights {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
