"""Layer-by-layer calibration driver shared by GPTQ and AWQ, plus the integer grids and module builders they share.

:func:`quantize_layerwise` runs the calibration tokens up to decoder layer 0, then walks the layers
in order: each layer with targets is deep-copied, the quantizer observes and rewrites the copy, and
the copy (now holding the dequantized weights) produces the next layer's inputs, so later layers
calibrate on the activations the quantized model will really see (GPTQ's sequential error
propagation). The user's model is only read: hooks that observe linears go on the copies, and the
pre-hooks that record what the model passes its decoder layers are removed before the function returns.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm  # widget bars in a notebook, text bars elsewhere

from ...core.errors import IncompatibleModelError
from ...core.introspect import ModelInfo, context_length, inspect_model
from ...core.step import StepConfig, bad_field
from ..api import KERNEL_GROUP_SIZES, Target, check_group_size
from ..formats.int4 import Int4Linear
from ..formats.int8 import Int8Linear
from ..formats.primitives import choose_qparams, dequantize, group_block, quantize

__all__ = [
    "GROUP_SIZES",
    "Grid",
    "LayerCall",
    "LayerRunner",
    "capture_layer_calls",
    "quantize_layerwise",
    "targets_by_layer",
    "build_quantized",
    "set_weight",
    "get_weight",
    "check_calibrated_config",
    "check_calibrated_model",
    "group_size_for",
]

GROUP_SIZES = KERNEL_GROUP_SIZES
"""Group sizes the calibrated quantizers take (the fused int4 kernels' sizes); ``-1`` (one group per
output row) is also accepted for ``bits=8``."""

BATCH_TOKENS = 8192
"""Tokens per batch when running a layer over the calibration set (bounds activation memory)."""


# -- integer grids ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Grid:
    """The integer grid GPTQ and AWQ round weights to (the formulas are :mod:`infopt.quantize.formats.primitives`').

    4 bits: codes 0..15 with a per-group zero point (fitted from min/max, or fixed at 8 when
    ``symmetric``; the same formulas as :func:`infopt.quantize.formats.int4.quantize_int4_grouped` with
    ``zero_point="int"``). 8 bits: always symmetric (``Int8Linear`` has no zero points): codes are stored
    shifted by 127, 0..254, so ``code - 127`` is the int8 value in -127..127. Scales are at least ``1e-8``.

    Example:
        >>> codes, scales, zeros = Grid(4).rtn(torch.tensor([[-1.0, 0.0, 2.0, 6.5]]), 4)
        >>> codes.tolist(), scales.tolist(), zeros.tolist()
        ([[0.0, 2.0, 6.0, 15.0]], [[0.5]], [[2.0]])
        >>> Grid.dequantize(codes, scales, zeros, 4).tolist()
        [[-1.0, 0.0, 2.0, 6.5]]
    """

    bits: int
    symmetric: bool = False

    @property
    def maxq(self) -> int:
        return 15 if self.bits == 4 else 254

    def fit(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``w``: ``[..., k]`` (one group per row) -> ``(scale, zero)``, each ``[...]`` fp32."""
        scale, zero = choose_qparams(w, group_block(w.shape), qmin=0, qmax=self.maxq,
                                     symmetric=self.bits == 8 or self.symmetric, eps=1e-8)  # [..., 1]
        return scale.squeeze(-1), zero.squeeze(-1)

    def quantize(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """Codes (float, 0..maxq) of ``w`` on the grid ``(scale, zero)`` (broadcast against ``w``)."""
        if scale.shape != w.shape:  # given per element
            scale, zero = scale.expand_as(w), zero.expand_as(w)
        return quantize(w, (1,) * w.dim(), scale, zero, qmin=0, qmax=self.maxq, dtype=torch.float32)

    def rtn(self, w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Round-to-nearest of ``w`` ``[out, in]`` per group -> ``(codes [out, in], scales [out, G], zeros [out, G])``."""
        w = w.float()
        block = group_block(w.shape, group_size)
        scale, zero = choose_qparams(w, block, qmin=0, qmax=self.maxq, symmetric=self.bits == 8 or self.symmetric,
                                     eps=1e-8)
        return quantize(w, block, scale, zero, qmin=0, qmax=self.maxq, dtype=torch.float32), scale, zero

    @staticmethod
    def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
        """``(codes - zeros) * scales`` per group: ``[out, in]`` fp32."""
        return dequantize(codes, group_block(codes.shape, group_size), scales, zeros)


def build_quantized(grid: Grid, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *, group_size: int,
                    bias: torch.Tensor | None, dtype: torch.dtype, in_perm: torch.Tensor | None = None,
                    per_channel: bool = False) -> nn.Module:
    """The replacement module for codes on ``grid``: an ``Int4Linear`` (4 bits) or ``Int8Linear`` (8 bits).

    Args:
        codes: ``[out, in]`` float codes 0..maxq, in the stored column order (after ``in_perm``).
        scales, zeros: ``[out, G]``.
        group_size: input channels per group (``in`` when ``per_channel``).
        bias: ``[out]`` or None.
        dtype: the model's dtype.
        in_perm: ``[in]`` int64: the layer computes ``x[..., in_perm] @ W.T`` (4 bits only).
        per_channel: one scale per output row (8 bits: the fused int8 kernel's layout).
    """
    if grid.bits == 4:
        return Int4Linear.from_codes(codes.to(torch.uint8), scales.float(), zeros.to(torch.uint8),
                                     group_size=group_size, bias=bias, in_perm=in_perm, dtype=dtype)
    if in_perm is not None:
        raise ValueError("Int8Linear has no input permutation; un-permute the codes first")
    q = (codes - 127).to(torch.int8)
    s = scales[:, 0] if per_channel else scales
    return Int8Linear.from_codes(q, s.float().contiguous(), bias=bias, dtype=dtype)


def get_weight(module: nn.Module, conv1d: bool) -> torch.Tensor:
    """The weight as fp32 ``[out, in]`` (a copy for a transformers ``Conv1D``)."""
    w = module.weight.detach()
    return (w.t() if conv1d else w).float()


def set_weight(module: nn.Module, w: torch.Tensor, conv1d: bool) -> None:
    """Write ``w`` ``[out, in]`` into ``module.weight`` (``[in, out]`` for ``Conv1D``), in its dtype."""
    with torch.no_grad():
        module.weight.copy_((w.t() if conv1d else w).to(module.weight.dtype))


# -- capture and replay ------------------------------------------------------------------------------
class _Stop(Exception):
    """Raised by the capture hook to end a forward once layer 0's inputs are recorded."""


@dataclass
class LayerCall:
    """What the model passes a decoder layer besides its hidden states: positional args after them and kwargs
    (attention mask, position embeddings, position ids, ...). Recorded on a batch of one and reused for
    every batch: they carry no batch dimension of their own beyond 1, so they broadcast."""

    args: tuple
    kwargs: dict[str, Any]


def _split_hidden(args: tuple, kwargs: dict) -> tuple[torch.Tensor, tuple, dict]:
    if args:
        return args[0], tuple(args[1:]), dict(kwargs)
    kwargs = dict(kwargs)
    return kwargs.pop("hidden_states"), (), kwargs


def capture_layer_calls(model: nn.Module, info: ModelInfo, ids: torch.Tensor
                        ) -> tuple[list[torch.Tensor], list[LayerCall]]:
    """Run ``model`` on ``ids`` ``[1, S]`` once and record, for every decoder layer, its input hidden states
    ``[1, S, H]`` and the other arguments the model passed it (per layer: Gemma 3 gives sliding and full
    attention layers different masks and rotary tables)."""
    layers = [model.get_submodule(f) for f in info.layer_fqns]
    hidden: list[Any] = [None] * len(layers)
    calls: list[Any] = [None] * len(layers)

    def make(i):
        def hook(mod, args, kwargs):
            h, rest, kw = _split_hidden(args, kwargs)
            hidden[i] = h.detach()
            calls[i] = LayerCall(rest, kw)

        return hook

    handles = [layer.register_forward_pre_hook(make(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    missing = [info.layer_fqns[i] for i, c in enumerate(calls) if c is None]
    if missing:
        raise IncompatibleModelError(f"the model's forward never called {missing[0]}; cannot calibrate it")
    return hidden, calls


def _first_layer_inputs(model: nn.Module, info: ModelInfo, ids: torch.Tensor, batch: int) -> list[torch.Tensor]:
    # -> list of [b, S, H] hidden states entering layer 0, one per batch of calibration rows
    layer0 = model.get_submodule(info.layer_fqns[0])
    got: list[torch.Tensor] = []

    def hook(mod, args, kwargs):
        got.append(_split_hidden(args, kwargs)[0].detach())
        raise _Stop

    h = layer0.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            for b0 in range(0, ids.shape[0], batch):
                try:
                    model(ids[b0:b0 + batch], use_cache=False)
                except _Stop:
                    pass
    finally:
        h.remove()
    return got


class LayerRunner:
    """Runs one decoder layer over the calibration batches, with the arguments the model gives that layer."""

    def __init__(self, call: LayerCall, inputs: list[torch.Tensor]):
        self.call = call
        self.inputs = inputs  # [b, S, H] per batch

    @property
    def tokens(self) -> int:
        return sum(x.shape[0] * x.shape[1] for x in self.inputs)

    def run(self, layer: nn.Module, taps: dict[str, nn.Module] | None = None,
            on_input: Callable[[str, torch.Tensor], None] | None = None,
            keep_outputs: bool = False) -> list[torch.Tensor] | None:
        """Run ``layer`` on every batch. ``on_input(name, x)`` sees the input ``x`` ``[b, S, in]`` of each module
        in ``taps`` (forward hooks, removed afterwards). Returns the outputs when ``keep_outputs``."""
        handles = []
        for name, mod in (taps or {}).items():
            handles.append(mod.register_forward_hook(lambda m, a, o, name=name: on_input(name, a[0])))
        outs = []
        try:
            with torch.no_grad():
                for x in self.inputs:
                    y = layer(x, *self.call.args, **self.call.kwargs)
                    if isinstance(y, tuple):
                        y = y[0]
                    if keep_outputs:
                        outs.append(y.detach())
        finally:
            for h in handles:
                h.remove()
        return outs if keep_outputs else None


def targets_by_layer(info: ModelInfo, targets: list[Target]) -> dict[int, dict[str, Target]]:
    """``{layer index: {name relative to the layer: target}}``.

    Raises:
        IncompatibleModelError: a target outside the decoder layers (the calibrated quantizers walk layers).
    """
    index = {f: i for i, f in enumerate(info.layer_fqns)}
    out: dict[int, dict[str, Target]] = {}
    for t in targets:
        parts = t.fqn.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            i = index.get(".".join(parts[:cut]))
            if i is not None:
                out.setdefault(i, {})[".".join(parts[cut:])] = t
                break
        else:
            raise IncompatibleModelError(
                f"{t.fqn} is not inside a decoder layer; calibrated quantizers (GPTQ, AWQ) only quantize the layers' "
                "projections. Exclude it with exclude=[...]"
            )
    return out


LayerFn = Callable[[int, nn.Module, LayerRunner, dict[str, Target]], dict[str, nn.Module]]


def quantize_layerwise(model: nn.Module, targets: list[Target], ids: torch.Tensor, quantize_layer: LayerFn, *,
                       desc: str, batch_tokens: int = BATCH_TOKENS) -> dict[str, nn.Module]:
    """Walk the decoder layers with calibration activations and collect each layer's replacements.

    Args:
        model: the model (read only).
        targets: the layers to quantize.
        ids: calibration token ids ``[n, S]``.
        quantize_layer: ``fn(index, work, runner, targets) -> {name relative to the layer: module}``. ``work``
            is a deep copy of the layer, ``targets`` maps relative names to targets. The function observes
            ``work`` with ``runner.run(work, taps, on_input)``, and must leave in ``work`` the weights
            the next layer's inputs should be computed with (the dequantized ones).
        desc: progress bar label.
        batch_tokens: calibration tokens per forward batch.

    Returns:
        ``{fqn: replacement module}`` (may include modules other than the targets, e.g. folded norms).
    """
    info = inspect_model(model)
    by_layer = targets_by_layer(info, targets)
    if not by_layer:
        return {}
    batch = max(1, batch_tokens // ids.shape[1])
    _, calls = capture_layer_calls(model, info, ids[:1])
    hidden = _first_layer_inputs(model, info, ids, batch)
    plan: dict[str, nn.Module] = {}
    last = max(by_layer)
    for i in tqdm(range(last + 1), desc=desc, unit="layer"):
        fqn = info.layer_fqns[i]
        layer = model.get_submodule(fqn)
        runner = LayerRunner(calls[i], hidden)
        if i in by_layer:
            work = copy.deepcopy(layer)
            with torch.no_grad():
                new = quantize_layer(i, work, runner, by_layer[i])
            plan.update({f"{fqn}.{rel}": mod for rel, mod in new.items()})
            layer = work
        if i < last:
            hidden = runner.run(layer, keep_outputs=True)
    return plan


# -- validation shared by the calibrated configs ----------------------------------------------------
def _positive_int(cfg: StepConfig, name: str) -> None:
    v = getattr(cfg, name)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise bad_field(cfg, name, v, "a positive integer")


def check_calibrated_config(cfg: StepConfig) -> None:
    """Field checks common to GPTQ and AWQ (``bits``, ``group_size``, ``samples``, ``seq_len``, ``symmetric``)."""
    if not isinstance(cfg.bits, int) or isinstance(cfg.bits, bool) or cfg.bits not in (4, 8):
        raise bad_field(cfg, "bits", cfg.bits, "4, 8")
    if not isinstance(cfg.group_size, int) or isinstance(cfg.group_size, bool) or cfg.group_size not in (*GROUP_SIZES, -1):
        raise bad_field(cfg, "group_size", cfg.group_size,
                        ", ".join(map(str, GROUP_SIZES)) + " (or -1, one scale per output row, with bits=8)")
    if cfg.group_size == -1 and cfg.bits != 8:
        raise bad_field(cfg, "group_size", cfg.group_size,
                        f"{', '.join(map(str, GROUP_SIZES))} with bits=4 (the int4 kernels need groups)")
    _positive_int(cfg, "samples")
    _positive_int(cfg, "seq_len")
    if not isinstance(cfg.symmetric, bool):
        raise bad_field(cfg, "symmetric", cfg.symmetric, "true or false")


def check_calibrated_model(cfg: StepConfig, model: nn.Module) -> None:
    """Model checks common to GPTQ and AWQ: ``group_size`` divides every target's ``in_features`` and
    ``seq_len`` fits the model's context.

    Raises:
        IncompatibleModelError: naming the layer and the group sizes that would work.
    """
    ctx = context_length(model)
    if ctx is not None and cfg.seq_len > ctx:
        raise IncompatibleModelError(
            f"{type(cfg).__name__}(seq_len={cfg.seq_len}) is longer than the model's context ({ctx} tokens); "
            f"use seq_len <= {ctx}"
        )
    if cfg.group_size != -1:
        check_group_size(model, cfg, cfg.group_size,
                         alternative="-1 for one scale per output row" if cfg.bits == 8 else None)


def group_size_for(cfg: StepConfig, in_features: int) -> int:
    """The group size in input channels (``in_features`` for ``-1``)."""
    return in_features if cfg.group_size == -1 else cfg.group_size
