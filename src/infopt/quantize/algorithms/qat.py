"""Quantization-aware training: fine-tune through fake-quantized linears, then convert to the int4/int8 layers.

Three pieces, used by the :class:`QAT` recipe step and by a training loop of your own:

- :class:`QATLinear`: a linear layer whose forward uses its weight rounded exactly as the conversion
  will round it (the round-to-nearest of :class:`~infopt.quantize.Int4WeightOnly` /
  :class:`~infopt.quantize.Int8WeightOnly`), with a straight-through estimator for the gradient.
- :func:`prepare_qat_`: swap the target linears for :class:`QATLinear` (trainable), recorded for undo.
- :func:`convert_qat_`: swap them for :class:`~infopt.quantize.Int4Linear` / :class:`~infopt.quantize.Int8Linear`
  built from the trained weights, recorded so that :func:`infopt.undo` restores the original model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ...core.errors import IncompatibleModelError, RecipeError
from ...core.introspect import inspect_model, param_bytes
from ...core.patch import get_handle, record_custom, swap_module
from ...core.save_hook import install_save_hook
from ...core.step import ApplyContext, StepConfig, bad_field, register_step, register_transform
from ..api import Target, check_group_size, quantize_targets, register_calibrated
from ..calibration.cache import cached_plan
from ..calibration.data import calibration_ids
from ..formats.int4 import Int4Linear, quantize_int4_grouped
from ..formats.int8 import Int8Linear, quantize_int8_per_channel
from ..formats.primitives import dequantize, group_block
from .layerwise import check_calibrated_config, check_calibrated_model
from .qat_train import DISTILL_TOP_K, finetune, param_groups, teacher_topk

__all__ = ["QAT", "QATLinear", "prepare_qat_", "convert_qat_", "qat_param_groups", "LOSSES", "SCALES",
           "DISTILL_TOP_K"]

LOSSES: tuple[str, ...] = ("distill", "next_token")
"""Training objectives of :class:`QAT` (see its ``loss`` field)."""

SCALES: tuple[str, ...] = ("learned", "minmax")
"""How :class:`QAT` sets each group's scale (see its ``scales`` field)."""

_TRAIN_STATE = "qat:train-state"  # target name of the record holding requires_grad / training flags


@register_step
@dataclass(frozen=True)
class QAT(StepConfig):
    """Quantization-aware training: a short fine-tune through fake-quantized linears, then conversion to
    the same ``Int4Linear`` (4 bits) or ``Int8Linear`` (8 bits) layers and kernels as round-to-nearest.

    The target linears (the attention and MLP projections, as :class:`~infopt.quantize.Int4WeightOnly` picks
    them; the output head and the embedding stay float) become :class:`QATLinear` layers. Their forward
    uses the weight rounded to the int grid, their backward passes the gradient straight through the
    rounding (straight-through estimator). After ``steps`` AdamW steps the trained weights are rounded
    once more, by the very function ``Int4WeightOnly`` / ``Int8WeightOnly`` use, into the real layers: so
    saving, reloading, ``from_pretrained``, tensor-parallel sharding and the fused kernels all apply.

    Scales (``scales``): ``"learned"`` (the default) gives each group's scale a trainable log-factor, started
    at 0 over the round-to-nearest grid of the weights before training (min/max, or absmax when symmetric) and
    trained on its own learning rate ``scale_lr``; the zero points stay where that grid put them. The rounding
    passes the gradient straight through, the clamp to the code range passes none outside it, so a scale can
    shrink below its min/max start and clip an outlier when that lowers the loss. ``"minmax"`` recomputes every
    group's grid from the current weights each step instead, as round-to-nearest would: nothing is clipped and
    no second learning rate exists. Either way the fake-quantized weight is the weight the conversion
    produces (the int4 kernels keep scales in bf16, the only difference), so the loss that was trained is the
    loss of the converted model. Measured on the default model at g64 with integer zero points, 150 steps
    (``benchmarks/qat_quality.py``, docs/quantize.md), one run each: the perplexity increase is +0.85 with min/max
    grids, +0.72 with learned scales at ``scale_lr`` 2e-3, +0.55 at 5e-3 (0.48x GPTQ's +1.15) and +0.71 at 1e-2;
    on the weights' own learning rate the scales stayed at their start.

    Only the swapped linears' weights and biases train, kept as fp32 master copies whatever the model's
    dtype; norms, embeddings and the head stay frozen. Quantization perturbs the linears, so they are
    the ones to compensate, and every trained tensor lives in a swapped module, so ``infopt.undo``
    restores the original model by putting its modules back (no other tensor ever changes).

    Training data: the same calibration source as :class:`~infopt.quantize.GPTQ`
    (:func:`~infopt.quantize.calibration.data.calibration_ids`; by default Python's documentation *after* the
    first 60,000 characters, which are the text :mod:`infopt.eval` scores, so the fine-tune never sees
    the evaluation text). ``samples`` rows of ``seq_len`` tokens, ``batch_size`` rows per step, in a
    seeded shuffled order. AdamW (betas 0.9/0.95, no weight decay: decay would shrink the weights and
    with them every group's grid), gradient norm clipped to ``max_grad_norm``, learning rate warmed up
    linearly over the first 10% of steps and then cosine-decayed to 10% of ``lr``. A progress bar shows
    the loss; the report's stats keep the whole loss log.

    Args:
        bits: 4 (``Int4Linear``: codes 0..15, scales and zero points per group) or 8 (``Int8Linear``, symmetric).
        group_size: input channels per scale (32, 64, 128, 256; -1 = one scale per output row, 8 bits only).
            It must divide every target's ``in_features`` (the default model's 576 takes 32 or 64).
        symmetric: 4-bit zero point fixed at 8 instead of fitted per group (8 bits are always symmetric).
        zero_point: 4 bits: ``"float"`` (the levels span each group's min..max exactly, the
            ``Int4WeightOnly`` default) or ``"int"`` (an integer zero point, GPTQ's format).
        scales: ``"learned"`` (a trained log-factor per group's scale, on ``scale_lr``) or ``"minmax"`` (each
            group's scale recomputed from the current weights every step); see above.
        scale_lr: the learned scales' peak AdamW learning rate (the weights' schedule, scaled), for
            ``scales="learned"``.
        steps: optimizer steps.
        lr: AdamW's peak learning rate.
        batch_size: calibration rows per step.
        samples: calibration rows (at most).
        seq_len: tokens per row (at most the model's context).
        max_grad_norm: the gradient norm is clipped to this.
        loss: ``"distill"`` (default): KL divergence from the float model's next-token distribution,
            computed once before training on its top :data:`DISTILL_TOP_K` tokens per position plus one
            bucket for the rest. The target is the original model, so training recovers what
            quantization lost and does not adapt the model to the calibration text (with
            ``"next_token"``, cross-entropy on the text, the fine-tune also learns the text's domain, and
            perplexity on text like it can fall below the float model's for that reason).
        seed: batch order (and dropout) seed.

    Raises:
        RecipeError: a field out of range (see each field).

    Example:
        >>> import torch
        >>> from infopt.models import tiny_model
        >>> from infopt.quantize import quantize_
        >>> ids = torch.randint(0, 49152, (2, 32), generator=torch.Generator().manual_seed(0))
        >>> cfg = QAT(group_size=32, steps=2, batch_size=2, samples=2, seq_len=32)
        >>> m = quantize_(tiny_model(), cfg, calibration=ids)
        >>> type(m.model.layers[0].mlp.up_proj).__name__
        'Int4Linear'
    """

    stage: ClassVar[str] = "quantize"
    kind: ClassVar[str] = "qat"
    discriminator: ClassVar[str] = "method"
    bits: int = 4
    group_size: int = 128
    symmetric: bool = False
    zero_point: str = "float"
    scales: str = "learned"
    scale_lr: float = 5e-3
    steps: int = 100
    lr: float = 2e-5
    batch_size: int = 4
    samples: int = 128
    seq_len: int = 256
    max_grad_norm: float = 1.0
    loss: str = "distill"
    seed: int = 0

    def __post_init__(self):
        check_calibrated_config(self)  # bits, group_size, samples, seq_len, symmetric
        if self.zero_point not in ("float", "int"):
            raise bad_field(self, "zero_point", self.zero_point, "float, int")
        if self.scales not in SCALES:
            raise bad_field(self, "scales", self.scales, ", ".join(SCALES))
        if not _number(self.scale_lr) or not 0 < self.scale_lr < 1:
            raise bad_field(self, "scale_lr", self.scale_lr, "a number in (0, 1), e.g. 5e-3")
        for name in ("steps", "batch_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise bad_field(self, name, v, "a positive integer")
        if not _number(self.lr) or not 0 < self.lr < 1:
            raise bad_field(self, "lr", self.lr, "a number in (0, 1), e.g. 2e-5")
        if not _number(self.max_grad_norm) or self.max_grad_norm <= 0:
            raise bad_field(self, "max_grad_norm", self.max_grad_norm, "a positive number, e.g. 1.0")
        if self.loss not in LOSSES:
            raise bad_field(self, "loss", self.loss, ", ".join(LOSSES))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise bad_field(self, "seed", self.seed, "an integer")

    def check(self, model, info, steps):
        _check_trainable(model)
        check_calibrated_model(self, model)  # group_size divides in_features; seq_len fits the context
        return []


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_trainable(model: nn.Module) -> None:
    """Refuse a model QAT cannot train: weights on the meta device, or inside ``torch.inference_mode``."""
    empty = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if empty:
        names = ", ".join(empty[:3]) + (f" and {len(empty) - 3} more" if len(empty) > 3 else "")
        raise IncompatibleModelError(
            f"QAT fine-tunes the model's weights, but {len(empty)} of its tensors are on the meta device ({names}): "
            "the model was built without weights (torch.device('meta'), init_empty_weights) or offloaded. Load the "
            "weights first (from_pretrained without an offloading device_map). Nothing was changed"
        )
    if torch.is_inference_mode_enabled():
        raise IncompatibleModelError(
            "QAT fine-tunes the model, which autograd cannot do inside torch.inference_mode(); apply it outside "
            "that block. Nothing was changed"
        )


class QATLinear(nn.Module):
    """A linear layer trained through fake quantization: the forward multiplies by the weight rounded to the
    :class:`QAT` config's int grid (the round-to-nearest of ``Int4WeightOnly`` / ``Int8WeightOnly``, scales
    recomputed from the current weight each call); the backward treats the rounding as the identity
    (straight-through estimator), so the gradient reaches the float weight.

    Parameters: ``weight`` fp32 ``[out, in]`` (a transformers ``Conv1D``'s is transposed on the way in) and
    ``bias`` fp32 ``[out]`` or None: master copies, trained whatever the model's dtype; outputs are in the
    original layer's dtype. :meth:`to_quantized` builds the real layer.

    Example:
        >>> lin = nn.Linear(64, 32)
        >>> q = QATLinear.from_float(lin, QAT(group_size=32))
        >>> x = torch.randn(3, 64)
        >>> q(x).sum().backward()
        >>> q.weight.grad.shape, type(q.to_quantized()).__name__
        (torch.Size([32, 64]), 'Int4Linear')
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, config: QAT, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.config = config
        self.out_dtype = dtype
        self.group_size = self.in_features if config.group_size == -1 else config.group_size
        if self.in_features % self.group_size:
            raise IncompatibleModelError(
                f"QATLinear: group_size {self.group_size} does not divide in_features {self.in_features}")
        self.weight = nn.Parameter(weight.detach().to(torch.float32, copy=True))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.float32, copy=True))
        self.keep_original = "disk"  # how prepare_qat_ kept the layer this replaced; convert_qat_ keeps it alike
        self.log_scale: nn.Parameter | None = None
        if config.scales == "learned":
            # the round-to-nearest grid of the starting weights, [out, G]; training moves log_scale from 0
            s0, z = self._minmax_grid(self._rounding_input())
            self.register_buffer("scale0", s0)
            self.register_buffer("zero", z)
            self.log_scale = nn.Parameter(torch.zeros_like(s0))

    @classmethod
    def from_float(cls, module: nn.Module, config: QAT, *, conv1d: bool = False) -> QATLinear:
        """From an ``nn.Linear`` (or a transformers ``Conv1D`` with ``conv1d=True``); the module is not changed."""
        w = module.weight.detach()
        return cls(w.t() if conv1d else w, getattr(module, "bias", None), config, w.dtype)

    def _rounding_input(self) -> torch.Tensor:
        # [out, in] fp32: the master weight as the converted layer will see it (cast through the model's dtype)
        return self.weight.detach().to(self.out_dtype).float()

    def _minmax_grid(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Round-to-nearest's ``(scales, zeros)`` of ``w``, each ``[out, G]`` fp32 (int8: zeros 0)."""
        _, scales, zeros = self._round_to_nearest(w)
        scales = scales.float().reshape(self.out_features, -1)
        return scales, torch.zeros_like(scales) if zeros is None else zeros.float()

    def _learned_scales(self) -> torch.Tensor:
        return (self.scale0 * self.log_scale.exp()).clamp_min(1e-12)  # [out, G], with the log-factor's gradient

    def grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The current ``(scales, zeros)``, ``[out, G]`` fp32: learned, or round-to-nearest's of the current weight
        (no gradient)."""
        if self.log_scale is None:
            return self._minmax_grid(self._rounding_input())
        return self._learned_scales().detach(), self.zero

    def _codes(self, w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
        """Rounded, clamped codes ``[out, G, group]`` of ``w`` on a grid; the rounding's gradient passes straight
        through, the clamp's is zero outside the code range."""
        lo, hi = (0, 15) if self.config.bits == 4 else (-127, 127)
        r = w.view(self.out_features, -1, self.group_size) / scales.unsqueeze(-1) + zeros.unsqueeze(-1)
        return (r + (r.round() - r).detach()).clamp(lo, hi)

    def _fake_quantized(self, w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
        return ((self._codes(w, scales, zeros) - zeros.unsqueeze(-1)) * scales.unsqueeze(-1)).reshape(w.shape)

    def _round_to_nearest(self, w: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(codes, scales, zeros)`` of ``w`` (default: the current weight) by ``Int4WeightOnly`` /
        ``Int8WeightOnly``'s own function (the min/max grid; int8: zeros None, scales ``[out]`` per row)."""
        w = self._rounding_input() if w is None else w
        g = None if self.config.group_size == -1 else self.group_size
        if self.config.bits == 4:
            return quantize_int4_grouped(w, self.group_size, self.config.symmetric, self.config.zero_point)
        q, scales = quantize_int8_per_channel(w, g)
        return q, scales, None

    def quantized_weight(self) -> torch.Tensor:
        """The fp32 ``[out, in]`` weight the converted layer stands for (no gradient)."""
        with torch.no_grad():
            if self.log_scale is not None:
                return self._fake_quantized(self._rounding_input(), *self.grid())
            codes, scales, zeros = self._round_to_nearest()
            g = None if self.config.group_size == -1 and self.config.bits == 8 else self.group_size
            return dequantize(codes, group_block(codes.shape, g), scales, zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.log_scale is None:
            # w + (wq - w).detach() is wq forward and the identity backward (STE)
            w = self.weight + (self.quantized_weight() - self.weight).detach()
        else:  # the scales learn through the fake quantization (the weight through its straight-through rounding)
            w = self._fake_quantized(self.weight, self._learned_scales(), self.zero)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, w.to(x.dtype), b)

    def to_quantized(self) -> nn.Module:
        """The ``Int4Linear`` / ``Int8Linear`` of the current weights on the current grid (min/max: built as
        ``Int4WeightOnly`` / ``Int8WeightOnly`` build theirs; ``compute_dtype="auto"`` for int8)."""
        bias = None if self.bias is None else self.bias.detach().to(self.out_dtype)
        with torch.no_grad():
            if self.log_scale is None:
                codes, scales, zeros = self._round_to_nearest()
            else:
                scales, zeros = self.grid()
                codes = self._codes(self._rounding_input(), scales, zeros).reshape(self.out_features, -1)
        if self.config.bits == 4:
            return Int4Linear.from_codes(codes.to(torch.uint8), scales, zeros, group_size=self.group_size, bias=bias,
                                         dtype=self.out_dtype)
        if self.config.group_size == -1 and scales.dim() == 2:
            scales = scales[:, 0]  # one scale per output row
        return Int8Linear.from_codes(codes.to(torch.int8), scales.contiguous(), bias=bias, dtype=self.out_dtype,
                                     compute_dtype="auto")

    def extra_repr(self) -> str:
        c = self.config
        g = "row" if c.group_size == -1 else c.group_size
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={c.bits}, group_size={g}, "
                f"bias={self.bias is not None}")


# -- prepare / convert ---------------------------------------------------------------------------------
def _record_train_state(model: nn.Module, step: str) -> None:
    """Record every parameter's ``requires_grad`` and every module's ``training`` flag, restored on undo."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    modes = [(m, m.training) for m in model.modules()]

    def restore() -> None:
        for p, f in flags:
            p.requires_grad_(f)
        for m, t in modes:
            m.training = t

    record_custom(model, _TRAIN_STATE, restore, step=step)


def _revert_since(model: nn.Module, mark: int) -> None:
    """Revert (newest first) and drop the records made on ``model`` since it had ``mark`` of them."""
    handle = get_handle(model)
    for rec in reversed(handle.records[mark:]):
        rec.revert()
    del handle.records[mark:]


def _prepare(model: nn.Module, config: QAT, targets: list[Target], keep_original: str) -> dict[str, QATLinear]:
    fake = {t.fqn: QATLinear.from_float(t.module, config, conv1d=t.conv1d) for t in targets}  # built first
    mark = len(get_handle(model).records)
    try:
        _record_train_state(model, config.key)
        for p in model.parameters():
            p.requires_grad_(False)
        for fqn, layer in fake.items():
            layer.keep_original = keep_original
            swap_module(model, fqn, layer, step=config.key, keep_original=keep_original)
        model.train()
    except BaseException:
        _revert_since(model, mark)
        raise
    return fake


def prepare_qat_(
    model: nn.Module,
    config: QAT,
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    include: list[str] | tuple[str, ...] | None = None,
    exclude: list[str] | tuple[str, ...] | None = None,
    keep_original: str = "disk",
) -> nn.Module:
    """Swap the target linears of ``model`` for :class:`QATLinear` layers and make the model trainable, in place.

    Afterwards only the :class:`QATLinear` weights and biases require grad (everything else is frozen) and the
    model is in train mode: train it with any loop, then call :func:`convert_qat_`. Every change is recorded,
    so :func:`infopt.undo` restores the original model bit for bit (layers, ``requires_grad``, train/eval mode)
    before or after conversion. Parameters you unfreeze yourself are not restored by undo.

    Args:
        model: a transformers causal LM with its weights loaded.
        config: the :class:`QAT` config (its training fields are ignored here: the loop is yours).
        filter_fn / include / exclude: pick the layers, as with :func:`~infopt.quantize.quantize_`.
        keep_original: ``"disk"`` (default): the original weights wait in a temporary file until undo;
            ``"memory"``: they stay in RAM.

    Returns:
        The same model.

    Raises:
        RecipeError: ``config`` is not a :class:`QAT`, or an unknown ``keep_original``.
        IncompatibleModelError: an unsupported architecture, weights on the meta device, a group size that
            does not divide a layer, or no layer to swap (an already prepared or quantized model).

    Example:
        >>> from infopt.models import tiny_model
        >>> m = prepare_qat_(tiny_model(), QAT(group_size=32))
        >>> type(m.model.layers[0].mlp.up_proj).__name__, m.training, m.model.embed_tokens.weight.requires_grad
        ('QATLinear', True, False)
    """
    if not isinstance(config, QAT):
        raise RecipeError(f"prepare_qat_ takes a quantize.QAT config, got {type(config).__name__}")
    if keep_original not in ("disk", "memory"):
        raise RecipeError(f"prepare_qat_(keep_original={keep_original!r}) is invalid; allowed: disk, memory")
    inspect_model(model)  # an unsupported architecture raises here
    _check_trainable(model)
    if config.group_size != -1:
        check_group_size(model, config, config.group_size,
                         alternative="-1 for one scale per output row" if config.bits == 8 else None)
    targets = quantize_targets(model, config, filter_fn, include, exclude)
    if not targets:
        raise IncompatibleModelError(
            "prepare_qat_ found no linear layer to swap; check include/exclude/filter_fn, or whether the model is "
            "already prepared (call convert_qat_) or quantized (call infopt.undo first)"
        )
    _prepare(model, config, targets, keep_original)
    return model


def _qat_layers(model: nn.Module) -> dict[str, QATLinear]:
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, QATLinear)}


def convert_qat_(model: nn.Module) -> nn.Module:
    """Replace every :class:`QATLinear` of ``model`` by its ``Int4Linear`` / ``Int8Linear``, in place.

    The records :func:`prepare_qat_` made are reverted first (the original layers come back, with every
    parameter's ``requires_grad`` and every module's train/eval mode as before ``prepare_qat_``), then the
    real layers are swapped in over the originals, as :func:`~infopt.quantize.quantize_` would swap them:
    :func:`infopt.undo` restores the original model bit for bit, and ``save_pretrained`` writes the
    ``quantization_config`` that plain ``from_pretrained`` rebuilds the layers from.

    Args:
        model: a model prepared with :func:`prepare_qat_` (and trained).

    Returns:
        The same model.

    Raises:
        RecipeError: the model has no :class:`QATLinear`.

    Example:
        >>> from infopt.models import tiny_model
        >>> m = convert_qat_(prepare_qat_(tiny_model(), QAT(group_size=32)))
        >>> type(m.model.layers[0].mlp.up_proj).__name__, m.training
        ('Int4Linear', False)
    """
    layers = _qat_layers(model)
    if not layers:
        raise RecipeError("convert_qat_: the model has no QATLinear layer; call prepare_qat_(model, QAT(...)) first")
    real = {fqn: layer.to_quantized() for fqn, layer in layers.items()}  # built first: a failure changes nothing
    configs = list(dict.fromkeys(layer.config for layer in layers.values()))
    handle = get_handle(model)
    # prepare_qat_'s records: the last live swap of each QATLinear's name, and the training-flag records
    last_swap: dict[str, Any] = {}
    for r in handle.records:
        if not r.undone and r.kind == "swap" and r.target in real:
            last_swap[r.target] = r
    ours = {id(r) for r in last_swap.values()}
    ours |= {id(r) for r in handle.records if not r.undone and r.kind == "custom" and r.target == _TRAIN_STATE}
    for r in reversed(handle.records):
        if id(r) in ours:
            r.revert()
    handle.records[:] = [r for r in handle.records if id(r) not in ours]
    for fqn, layer in real.items():
        layer.train(model.get_submodule(fqn).training)  # the original's mode, now that the flags are restored
        swap_module(model, fqn, layer, step=layers[fqn].config.key, keep_original=layers[fqn].keep_original)
    if callable(getattr(model, "save_pretrained", None)):
        for c in configs:
            install_save_hook(model, step=c.key, quantize_config=c)
    return model


def qat_param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """The optimizer parameter groups for training a model :func:`prepare_qat_` prepared with a loop of your own:
    the :class:`QATLinear` weights and biases at the config's ``lr``, and their learned scales (``scales="learned"``)
    at its ``scale_lr`` (on the weights' learning rate they barely move).

    Example:
        >>> from infopt.models import tiny_model
        >>> m = prepare_qat_(tiny_model(), QAT(group_size=32))
        >>> opt = torch.optim.AdamW(qat_param_groups(m))
        >>> [g["lr"] for g in opt.param_groups]
        [2e-05, 0.005]
    """
    layers = list(_qat_layers(model).values())
    if not layers:
        raise RecipeError("qat_param_groups: the model has no QATLinear layer; call prepare_qat_(model, QAT(...)) "
                          "first")
    configs = dict.fromkeys(layer.config for layer in layers)  # one QAT config per prepare_qat_ call
    return [g for c in configs for g in param_groups([la for la in layers if la.config == c], c)]


def _run(model: nn.Module, config: QAT, targets: list[Target], ids: torch.Tensor | None, rebuild: bool
         ) -> tuple[dict[str, nn.Module], dict[str, Any]]:
    """``({fqn: Int4Linear/Int8Linear}, training stats)``; the model is left as it was (its records reverted)."""
    if rebuild:  # structure only: saved weights are loaded over these
        return {t.fqn: QATLinear.from_float(t.module, config, conv1d=t.conv1d).to_quantized() for t in targets}, {}
    t0 = time.perf_counter()
    teacher = teacher_topk(model, ids, config.batch_size) if config.loss == "distill" else None
    t1 = time.perf_counter()
    mark = len(get_handle(model).records)
    try:
        layers = _prepare(model, config, targets, keep_original="disk")
        log = finetune(model, layers, ids, teacher, config)
        real = {fqn: layer.to_quantized() for fqn, layer in layers.items()}
    finally:
        _revert_since(model, mark)  # the original layers and flags back; the caller swaps ``real`` in
    stats = {"loss": config.loss, "loss_first": log[0], "loss_last": log[-1], "loss_log": log,
             "train_steps": len(log), "train_seconds": time.perf_counter() - t1, "teacher_seconds": t1 - t0,
             "train_tokens": len(log) * min(config.batch_size, ids.shape[0]) * ids.shape[1]}
    return real, stats


@register_calibrated(QAT)
def _plan(model: nn.Module, config: QAT, targets: list[Target], calibration: torch.Tensor | None,
          rebuild: bool) -> dict[str, nn.Module]:
    return _run(model, config, targets, calibration, rebuild)[0]


@register_transform(QAT)  # replaces the generic transform register_calibrated installed: it also reports the losses
def _apply(model: nn.Module, config: QAT, ctx: ApplyContext) -> None:
    before = param_bytes(model)
    targets = quantize_targets(model, config)
    if not targets:
        raise IncompatibleModelError("QAT found no linear layer to quantize; is the model already quantized?")
    ids = None if ctx.rebuild else calibration_ids(model, ctx.calibration, tokenizer=ctx.tokenizer,
                                                   samples=config.samples, seq_len=config.seq_len)
    if ctx.rebuild:
        real, stats = _run(model, config, targets, ids, True)
    else:  # trained once per (weights, config, targets, ids): see calibration_cache
        real, stats = cached_plan(model, config, targets, ids, lambda: _run(model, config, targets, ids, False),
                                  rebuild=lambda: _run(model, config, targets, None, True)[0])
    for fqn, layer in real.items():
        layer.train(model.get_submodule(fqn).training)
        swap_module(model, fqn, layer, step=config.key, keep_original="disk")
    if callable(getattr(model, "save_pretrained", None)):
        install_save_hook(model, step=config.key, quantize_config=config)
    after = param_bytes(model)
    ctx.stats.update(modules_quantized=len(real), weight_bytes_before=before, weight_bytes_after=after, **stats)
    g = "row" if config.group_size == -1 else f"g{config.group_size}"
    trained = "" if ctx.rebuild else (
        f" after {stats['train_steps']} QAT steps ({stats['train_seconds']:.0f} s, {config.loss} loss "
        f"{stats['loss_first']:.4g} -> {stats['loss_last']:.4g})")
    ctx.notes.append(f"{len(real)} linear layers -> int{config.bits} {g}{trained}; weights "
                     f"{before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
