"""``quantize_``: the one verb that applies any quantization config to a model's linear layers.

Two kinds of quantizer register here, beside their configs:

- :func:`register_quantizer` — round-to-nearest style: ``make(module, config, conv1d) -> new module``,
  one layer at a time, no data needed.
- :func:`register_calibrated` — needs activations (GPTQ, AWQ, SmoothQuant):
  ``plan(model, config, targets, calibration, rebuild) -> {fqn: new module}``. The plan may also
  replace modules other than the targets (a norm with AWQ scales folded into it). Nothing is swapped
  until the whole plan is built, so a failure leaves the model untouched.

Both get the same generic transform, so each config is also a recipe step.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.errors import IncompatibleModelError, RecipeError, did_you_mean
from ..core.introspect import inspect_model, param_bytes
from ..core.moe import moe_blocks
from ..core.patch import swap_module
from ..core.save_hook import install_save_hook
from ..core.step import ApplyContext, StepConfig, register_transform
from .calibration.cache import cached_plan
from .calibration.data import calibration_ids
from .experts import EXPERT_QUANTIZERS, experts_targets

__all__ = ["quantize_", "QUANTIZERS", "CALIBRATED", "Target", "register_quantizer", "register_calibrated",
           "quantize_targets", "check_group_size", "KERNEL_GROUP_SIZES", "SHARED_EMBEDDINGS", "register_shared_embedding",
           "KEEP_LEVELS", "check_keep", "keep_level", "target_config", "head_tied", "shared_embedding"]

KERNEL_GROUP_SIZES = (32, 64, 128, 256)
"""Group sizes the fused int4 kernels accept (and the ones grouped configs suggest)."""


@dataclass(frozen=True)
class Target:
    """A layer ``quantize_`` will replace: its dotted name, the module, and whether it is a
    transformers ``Conv1D`` (weight stored ``[in, out]``) rather than an ``nn.Linear``."""

    fqn: str
    module: nn.Module
    conv1d: bool

    @property
    def weight(self) -> torch.Tensor:
        """The weight as ``[out, in]`` whatever the layer type."""
        w = self.module.weight.detach()
        return w.t() if self.conv1d else w


# config type -> make(module, config, conv1d) -> replacement module
QUANTIZERS: dict[type[StepConfig], Callable[[nn.Module, Any, bool], nn.Module]] = {}
# config type -> plan(model, config, targets, calibration, rebuild) -> {fqn: replacement}
CALIBRATED: dict[type[StepConfig], Callable[..., dict[str, nn.Module]]] = {}


SHARED_EMBEDDINGS: list[type[nn.Module]] = []
"""Embedding classes that read a quantized output head's codes (``share_embedding=True``), each with a
``for_head(head, embedding) -> module | None``: :class:`~infopt.quantize.formats.int8.SharedInt8Embedding`, listed by
:func:`register_shared_embedding` beside its class (this module does not import the layers it swaps in)."""


def register_shared_embedding(cls: type[nn.Module]) -> type[nn.Module]:
    """Class decorator: list ``cls`` in :data:`SHARED_EMBEDDINGS`, so ``share_embedding=True`` builds it for a
    head it accepts.

    Example:
        >>> from infopt.quantize.formats.int8 import SharedInt8Embedding
        >>> register_shared_embedding(SharedInt8Embedding) is SharedInt8Embedding, SHARED_EMBEDDINGS.count(SharedInt8Embedding)
        (True, 1)
    """
    if cls not in SHARED_EMBEDDINGS:
        SHARED_EMBEDDINGS.append(cls)
    return cls


def register_quantizer(config_cls: type[StepConfig]):
    """Decorator: ``make(module, config, conv1d) -> nn.Module`` builds one layer's replacement for ``config_cls``
    (and the config becomes a recipe step with the generic quantize transform)."""

    def deco(fn):
        QUANTIZERS[config_cls] = fn
        register_transform(config_cls)(_apply)
        return fn

    return deco


def register_calibrated(config_cls: type[StepConfig]):
    """Decorator: ``plan(model, config, targets, calibration, rebuild) -> {fqn: nn.Module}`` for a config that
    needs activations. ``calibration`` is a ``[n, seq]`` int64 tensor of token ids (see
    :func:`infopt.quantize.calibration.data.calibration_ids`); with ``rebuild=True`` the plan only builds
    modules of the right structure (saved weights are loaded over them) and ``calibration`` is None."""

    def deco(fn):
        CALIBRATED[config_cls] = fn
        register_transform(config_cls)(_apply)
        return fn

    return deco


KEEP_LEVELS = ("float-activations", "int8", "float")
"""What a ``keep`` entry of a quantize config may keep a layer as, mildest first: ``float-activations`` (its quantized
weights multiply floating-point activations: no int8 activations), ``int8`` (8-bit weights, floating-point
activations), ``float`` (not quantized). :mod:`infopt.quantize.bound` fills ``keep`` to hold a ``max_kl`` bound."""


def check_keep(config: StepConfig) -> None:
    """Raise :class:`RecipeError` unless ``config.keep`` is a list of ``"PATTERN=LEVEL"`` strings, each ``PATTERN`` a
    glob on a layer's dotted name and ``LEVEL`` one of :data:`KEEP_LEVELS`.

    Example:
        >>> from infopt.quantize import Int4WeightOnly
        >>> Int4WeightOnly(group_size=32, keep=("lm_head=float",)).keep
        ('lm_head=float',)
        >>> Int4WeightOnly(group_size=32, keep=("lm_head=fp32",))
        Traceback (most recent call last):
        ...
        infopt.core.errors.RecipeError: Int4WeightOnly.keep entry 'lm_head=fp32' is invalid: ... one of float-activations, int8, float....
    """
    keep = getattr(config, "keep", ())
    name = type(config).__name__
    if not isinstance(keep, tuple) or not all(isinstance(e, str) for e in keep):
        raise RecipeError(f"{name}.keep must be a list of 'PATTERN=LEVEL' strings (e.g. ['lm_head=float']), got "
                          f"{keep!r}")
    for e in keep:
        pattern, sep, level = e.rpartition("=")
        if not sep or not pattern or level not in KEEP_LEVELS:
            raise RecipeError(f"{name}.keep entry {e!r} is invalid: write 'PATTERN=LEVEL', PATTERN a glob on the "
                              f"layer's dotted name (model.layers.3.mlp.down_proj, *.down_proj) and LEVEL one of "
                              f"{', '.join(KEEP_LEVELS)}.{did_you_mean(level, KEEP_LEVELS)}")
    bound = getattr(config, "max_kl", None)
    if bound is not None and (not isinstance(bound, (int, float)) or isinstance(bound, bool) or not bound > 0):
        raise RecipeError(f"{name}.max_kl={bound!r} is invalid: a KL divergence bound in nats/token, a number > 0 "
                          "(e.g. 0.02), or null for no bound")


def keep_level(config: StepConfig, fqn: str) -> str | None:
    """The level ``config.keep`` keeps the layer ``fqn`` at (the last matching entry wins), or None.

    Example:
        >>> from infopt.quantize import Int4WeightOnly
        >>> c = Int4WeightOnly(group_size=32, keep=("*.down_proj=int8", "model.layers.1.mlp.down_proj=float"))
        >>> keep_level(c, "model.layers.0.mlp.down_proj"), keep_level(c, "model.layers.1.mlp.down_proj")
        ('int8', 'float')
    """
    level = None
    for e in getattr(config, "keep", ()):
        pattern, _, lv = e.rpartition("=")
        if fnmatch.fnmatchcase(fqn, pattern):
            level = lv
    return level


def target_config(config: StepConfig, fqn: str, head_fqn: str | None, level: str | None = None) -> StepConfig | None:
    """The config one layer is quantized with: the head's (``config.head_config()``) for ``head_fqn``, else
    ``config``, changed by its :func:`keep_level` (or ``level`` when given) through the config's ``kept_as``;
    None when the layer stays in float.

    Example:
        >>> from infopt.quantize import Int4WeightOnly
        >>> c = Int4WeightOnly(group_size=32, include_lm_head=True, keep=("*.o_proj=int8",))
        >>> [type(target_config(c, f, "lm_head")).__name__ for f in ("model.layers.0.mlp.up_proj", "lm_head",
        ...                                                           "model.layers.0.self_attn.o_proj")]
        ['Int4WeightOnly', 'Int8WeightOnly', 'Int8WeightOnly']
        >>> target_config(c, "lm_head", "lm_head", "float") is None
        True
    """
    base = config
    if fqn == head_fqn:
        base = getattr(config, "head_config", lambda: None)() or config
    level = keep_level(config, fqn) if level is None else level
    if level is None:
        return base
    if level == "float":
        return None
    return base.kept_as(level)


def _known() -> str:
    return ", ".join(sorted(c.__name__ for c in (*QUANTIZERS, *CALIBRATED)))


def quantize_targets(model: nn.Module, config: StepConfig, filter_fn=None, include=None, exclude=None) -> list[Target]:
    """The layers ``quantize_(model, config, ...)`` would replace, in model order."""
    info = inspect_model(model)
    names = list(info.attn_linear_fqns) + list(info.mlp_linear_fqns)
    if getattr(config, "include_lm_head", False):
        # a head tied to the input embedding gets its own quantized copy; the embedding keeps its weight
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
        if keep_level(config, fqn) == "float":
            continue
        is_conv1d = type(mod).__name__ == "Conv1D"
        if not isinstance(mod, nn.Linear) and not is_conv1d:
            continue  # already swapped, or a layer type this config does not handle
        out.append(Target(fqn, mod, is_conv1d))
    return out


def check_group_size(model: nn.Module, config: StepConfig, group_size: int, *, alternative: str | None = None,
                     skip: tuple[str, ...] = ()) -> None:
    """Raise :class:`IncompatibleModelError` naming the first target layer whose ``in_features`` ``group_size``
    does not divide, with the kernel group sizes (largest first) that divide every layer ``config`` quantizes
    (the linear targets and each quantized experts module's input widths), so any size the message offers is one
    the model then accepts, and ``alternative`` if given.

    Args:
        skip: dotted names of targets quantized some other way (not checked).

    Raises:
        IncompatibleModelError: ``group_size`` does not divide a target's ``in_features``.
    """
    targets = [t for t in quantize_targets(model, config) if t.fqn not in skip]
    bad = next((t for t in targets if t.weight.shape[1] % group_size), None)
    if bad is None:
        return
    widths = {t.fqn: int(t.weight.shape[1]) for t in targets}
    wanted = set(experts_targets(model, config))
    experts = set()
    for b in moe_blocks(model):
        if b.experts_fqn in wanted:  # gate_up reads the hidden width H, down the intermediate width I
            widths[f"{b.experts_fqn}.gate_up_proj"] = b.hidden_size
            widths[f"{b.experts_fqn}.down_proj"] = b.intermediate_size
            experts |= {f"{b.experts_fqn}.gate_up_proj", f"{b.experts_fqn}.down_proj"}
    ok = _sizes_dividing(widths.values())
    if ok:
        fix = f"use group_size {' or '.join(map(str, ok))}"
        if len(set(widths.values())) > 1:
            fix += " (the sizes that divide every layer it quantizes)"
    else:
        # a layer no kernel size divides: no group size serves this model, so offer none
        stuck = [n for n, w in widths.items() if not _sizes_dividing([w])]
        shown = ", ".join(f"{n} ({widths[n]})" for n in stuck[:3]) + (f" and {len(stuck) - 3} more" if len(stuck) > 3
                                                                      else "")
        fix = (f"no group size of {', '.join(map(str, KERNEL_GROUP_SIZES))} divides the input width of {shown}, so "
               f"{type(config).__name__} cannot quantize this model")
        if experts.intersection(stuck):
            fix += " (experts=False leaves the experts in float)"
    if alternative:
        fix += f" (or {alternative})"
    raise IncompatibleModelError(
        f"{type(config).__name__}(group_size={group_size}) does not divide {bad.fqn}.in_features="
        f"{bad.weight.shape[1]}; {fix}"
    )


def _sizes_dividing(widths) -> list[int]:
    """The kernel group sizes, largest first, that divide every width."""
    widths = list(widths)
    return [g for g in sorted(KERNEL_GROUP_SIZES, reverse=True) if all(w % g == 0 for w in widths)]


def quantize_(
    model: nn.Module,
    config: StepConfig,
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    include: list[str] | tuple[str, ...] | None = None,
    exclude: list[str] | tuple[str, ...] | None = None,
    calibration: Any = None,
    tokenizer: Any = None,
    keep_original: str = "disk",
    step: str | None = None,
    rebuild: bool = False,
    layers: dict[str, nn.Module | None] | None = None,
) -> nn.Module:
    """Quantize the attention and MLP projections of ``model`` in place.

    Args:
        model: a transformers causal LM (see :data:`infopt.core.introspect.SUPPORTED_MODEL_TYPES`).
        config: a quantization config such as :class:`Int8WeightOnly`.
        filter_fn: ``filter_fn(module, fqn) -> bool`` picks the layers to quantize.
        include / exclude: glob patterns on the layer's dotted name (``"*.mlp.*"``).
        calibration: for configs that need activations (GPTQ, AWQ, SmoothQuant): token ids
            ``[n, seq]``, a list of id tensors, or a list of strings (encoded with ``tokenizer``).
            None: a slice of Python's documentation text disjoint from the one :mod:`infopt.eval`
            scores. Ignored by round-to-nearest configs.
        tokenizer: encodes string calibration data (default: the embedded default model's tokenizer,
            usable when the model shares its vocabulary).
        keep_original: ``"disk"`` (default) moves the original weights to a temporary file so their
            memory is freed while :func:`infopt.undo` can still restore them bit for bit;
            ``"memory"`` keeps them in RAM (faster undo, no memory saved).
        rebuild: build modules of the right structure without calibrating (for loading saved weights).
        layers: replacements already built for ``config`` by name (:func:`infopt.quantize.bound.fit_bound`'s), used
            instead of building them again (round-to-nearest configs).

    Returns:
        The same model.

    Raises:
        RecipeError: ``config`` is not a quantization config, or bad calibration data.
        IncompatibleModelError: the model's architecture is not supported, or nothing matched.

    Example:
        >>> from infopt.models import tiny_model
        >>> from infopt.quantize import Int8WeightOnly
        >>> m = quantize_(tiny_model(), Int8WeightOnly(), include=["*.mlp.*"])
        >>> type(m.model.layers[0].self_attn.q_proj).__name__, type(m.model.layers[0].mlp.up_proj).__name__
        ('Linear', 'Int8Linear')
    """
    if type(config) not in QUANTIZERS and type(config) not in CALIBRATED:
        raise RecipeError(f"quantize_ got {type(config).__name__}; expected one of: {_known()}")
    info = inspect_model(model)
    check = getattr(config, "check", None)
    if check is not None:
        check(model, info, (config,))
    targets = quantize_targets(model, config, filter_fn, include, exclude)
    experts = experts_targets(model, config, filter_fn, include, exclude)
    if not targets and not experts:
        raise IncompatibleModelError(
            f"quantize_({type(config).__name__}) found no linear layer to quantize; check include/exclude/filter_fn, "
            "or whether the model is already quantized"
        )
    # build every replacement first, so a failure leaves the model untouched
    if type(config) in QUANTIZERS:
        replacements = {}
        for t in targets:
            if layers is not None and layers.get(t.fqn) is not None:
                replacements[t.fqn] = layers[t.fqn]
                continue
            cfg = target_config(config, t.fqn, info.lm_head_fqn)
            replacements[t.fqn] = QUANTIZERS[type(cfg)](t.module, cfg, t.conv1d)
        if getattr(config, "share_embedding", False):
            replacements.update(_shared_embedding(model, info, replacements))
    else:
        ids = None
        if not rebuild:
            ids = calibration_ids(model, calibration, tokenizer=tokenizer,
                                  samples=getattr(config, "samples", 32), seq_len=getattr(config, "seq_len", 512))
        plan = CALIBRATED[type(config)]
        if rebuild:
            replacements = plan(model, config, targets, None, True)
        else:  # computed once per (weights, config, targets, ids): see calibration_cache
            replacements, _ = cached_plan(model, config, targets, ids,
                                          lambda: (plan(model, config, targets, ids, False), {}),
                                          rebuild=lambda: plan(model, config, targets, None, True))
    for fqn in experts:  # MoE experts (3D weights): one quantized layer per expert and projection
        replacements[fqn] = EXPERT_QUANTIZERS[type(config)](model.get_submodule(fqn), config)
    for fqn, new in replacements.items():
        swap_module(model, fqn, new, step=step or config.key, keep_original=keep_original)
    if callable(getattr(model, "save_pretrained", None)):
        # save_pretrained then writes the quantization_config that plain from_pretrained rebuilds the layers from
        install_save_hook(model, step=step or config.key, quantize_config=config)
    return model


def head_tied(model: nn.Module, info) -> bool:
    """Whether ``model``'s output head reads its input embedding's weight (``info``: its :class:`ModelInfo`)."""
    embed = model.get_submodule(info.embed_fqn)
    head = model.get_submodule(info.lm_head_fqn)
    return embed is not None and getattr(head, "weight", None) is getattr(embed, "weight", None)


def shared_embedding(head: nn.Module | None, embedding: nn.Module) -> nn.Module | None:
    """The embedding of :data:`SHARED_EMBEDDINGS` that reads ``head``'s codes in place of ``embedding`` (the caller
    checks the tie, :func:`head_tied`), or None when none accepts the pair."""
    for cls in SHARED_EMBEDDINGS:
        shared = cls.for_head(head, embedding)
        if shared is not None:
            return shared
    return None


def _shared_embedding(model: nn.Module, info, replacements: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """``{embedding fqn: SharedInt8Embedding}`` when the new head is an :class:`Int8Linear` built from a head tied to
    an embedding it can stand in for (one of :data:`SHARED_EMBEDDINGS` accepts it); else nothing (the embedding
    keeps its weight)."""
    if not head_tied(model, info):
        return {}
    shared = shared_embedding(replacements.get(info.lm_head_fqn), model.get_submodule(info.embed_fqn))
    return {} if shared is None else {info.embed_fqn: shared}


def _apply(model: nn.Module, config: StepConfig, ctx: ApplyContext) -> None:
    layers = None
    if getattr(config, "max_kl", None) is not None and not ctx.rebuild:
        # the config measures itself against its bound and comes back with the layers it keeps (infopt.quantize.bound)
        config, fit, layers = config.fit_bound(model, tokenizer=ctx.tokenizer, calibration=ctx.calibration)
        ctx.config = config
        ctx.stats["bound"] = fit.to_dict()
        ctx.notes.extend(fit.notes())
    before = param_bytes(model)
    n = len(quantize_targets(model, config))
    n_experts = len(experts_targets(model, config))
    blocks = moe_blocks(model)
    quantize_(model, config, calibration=ctx.calibration, tokenizer=ctx.tokenizer, rebuild=ctx.rebuild,
              step=config.key, layers=layers)
    after = param_bytes(model)
    ctx.stats["modules_quantized"] = n
    ctx.stats["weight_bytes_before"] = before
    ctx.stats["weight_bytes_after"] = after
    ctx.notes.append(f"{n} linear layers -> {type(config).__name__}; weights {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
    if blocks:
        ctx.stats["experts_quantized"] = n_experts
        if n_experts:
            ctx.notes.append(f"{n_experts} of {len(blocks)} MoE experts modules quantized per expert; routers stay float")
        else:
            why = "experts=False" if type(config) in EXPERT_QUANTIZERS else \
                f"{type(config).__name__} quantizes linear layers only (int8/int4 weight-only also quantize experts)"
            ctx.notes.append(f"the {len(blocks)} MoE experts modules stay in float ({why})")
    if getattr(config, "share_embedding", False):
        shared = isinstance(model.get_input_embeddings(), tuple(SHARED_EMBEDDINGS))
        ctx.stats["embedding_shared"] = shared
        ctx.notes.append("the input embedding reads the int8 head's codes" if shared else
                         "share_embedding: the embedding keeps its weight (the head is not tied to it, or the "
                         "embedding has max_norm or a non-scalar scale)")
