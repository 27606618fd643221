"""Hold a quantize step to its stated error bound: measure, and keep in higher precision what breaks it.

A config with ``max_kl`` (:class:`~infopt.quantize.formats.int4.Int4WeightOnly`,
:class:`~infopt.quantize.formats.int8.Int8WeightOnly`; the ``cpu-fast`` and ``memory-saver`` presets set 0.02) is fitted
before any layer is swapped:

1. One forward of the unquantized model over :data:`BOUND_TOKENS` tokens of calibration text (disjoint from the text
   :mod:`infopt.eval` scores) keeps the reference logits.
2. The replacements go in (without being recorded) and the whole model's KL against the reference is measured as
   decoding computes it (:data:`DECODE_ROWS` tokens per forward). Within the bound: done, nothing kept.
3. Otherwise one forward and backward of the unquantized model estimates, for every layer and each level it could be
   kept at (int8 activations dropped, 8-bit weights, float), the KL that layer alone would add (the Fisher
   approximation, :func:`_estimate`). The remedies are ordered by estimated gain, and the shortest prefix of that
   order that holds the bound is searched for (doubling, then halving: one measured forward per try), so no more is
   kept than the measurement asks.

The result is the config with ``keep`` entries for the kept layers (a saved model's recipe carries them, so loading
rebuilds the same layers without measuring) and a :class:`BoundFit` for the report.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from ..core.compat import CACHE_KWARG
from ..core.errors import RecipeError
from ..core.introspect import inspect_model
from ..core.step import StepConfig
from .api import (
    KEEP_LEVELS,
    QUANTIZERS,
    Target,
    head_tied,
    keep_level,
    quantize_targets,
    shared_embedding,
    target_config,
)
from .calibration.data import calibration_ids

__all__ = ["BOUND_TOKENS", "BoundFit", "HoldsBound", "fit_bound", "int8_activations"]

log = logging.getLogger(__name__)

BOUND_TOKENS = 256
"""Tokens of calibration text a bound is measured on (one forward each try)."""

DECODE_ROWS = 16
"""Rows per call while measuring: below every row count at which a quantized layer leaves its decode kernel for a
prompt path (a dequantized GEMM, :data:`~infopt.quantize.formats.int4.A8_DENSE_MIN_ROWS`), so the error measured is
the error decoding has, int8 activations included."""

_NEARLY = 0.9
"""A milder level is taken over a stronger one that gains at most 1/0.9 as much (estimated)."""


@dataclass
class BoundFit:
    """How a quantize step held its ``max_kl`` bound (in the step's report as ``stats["bound"]``).

    Attributes:
        max_kl: the bound, nats/token.
        kl_quantized: the KL with every layer quantized as configured (``keep`` as given).
        kl: the KL as finally kept; ``top1``: its top-1 agreement.
        tokens: tokens measured on.
        kept: ``{layer: level}`` for each layer the fit kept in higher precision (:data:`~infopt.quantize.api.KEEP_LEVELS`).
        why: ``{layer: reason}``, the layer's measured error behind each kept level.
        tries: forwards of the quantized model measured; ``seconds``: the fit's wall time.
    """

    max_kl: float
    kl_quantized: float
    kl: float
    top1: float
    tokens: int
    kept: dict[str, str] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)
    tries: int = 1
    seconds: float = 0.0

    @property
    def held(self) -> bool:
        """Whether the final KL is within the bound."""
        return self.kl <= self.max_kl

    def notes(self) -> list[str]:
        """Report lines: the bound, what was measured, what was kept and why."""
        head = (f"error bound KL <= {self.max_kl:g}: measured {self.kl_quantized:.4f} nats/token on {self.tokens} tokens "
                "of calibration text")
        if not self.kept:
            return [head + " with every layer as configured; nothing kept"]
        lines = [head + f" as configured; kept {len(self.kept)} layer(s) in higher precision -> KL {self.kl:.4f}, "
                        f"top-1 {self.top1:.3f} ({self.tries} measurements, {self.seconds:.1f} s):"]
        lines += [f"  {fqn}: {level} ({self.why.get(fqn, '')})" for fqn, level in self.kept.items()]
        if not self.held:
            lines.append(f"  the bound still breaks with every layer kept in float (KL {self.kl:.4f}): the error "
                         "comes from outside the quantized layers")
        return lines

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class HoldsBound:
    """What a quantize config with ``max_kl`` and ``keep`` fields inherits: :meth:`fit_bound`, which the generic
    quantize transform calls before building its layers (the config also gives ``kept_as(level)``)."""

    def fit_bound(self, model: nn.Module, *, tokenizer: Any = None, calibration: Any = None
                  ) -> tuple[StepConfig, BoundFit, dict[str, nn.Module | None]]:
        """This config with the ``keep`` entries that hold its ``max_kl`` on ``model``, the measurement and the
        layers built (:func:`fit_bound`)."""
        return fit_bound(model, self, tokenizer=tokenizer, calibration=calibration)


def int8_activations(layer: nn.Module) -> bool:
    """Whether a quantized layer quantizes its activations to int8 (an ``a8`` layout)."""
    # (formats.int4_layouts.A8_LAYOUTS: formats imports this module, so the names are spelled here)
    return getattr(layer, "layout", None) in ("a8", "a8_sym", "a8_k") or getattr(layer, "activations", None) == "int8"


def _in_rows(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn`` over ``x`` ``[..., in]`` in calls of at most :data:`DECODE_ROWS` rows."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.cat([fn(flat[i:i + DECODE_ROWS]) for i in range(0, flat.shape[0], DECODE_ROWS)])
    return out.view(*x.shape[:-1], out.shape[-1])


def _logits_in_rows(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits over ``ids`` ``[1, T]``, fed :data:`DECODE_ROWS` tokens per forward through a KV cache."""
    cache = DynamicCache(config=model.config)
    out = []
    for i in range(0, ids.shape[1], DECODE_ROWS):
        out.append(model(ids[:, i:i + DECODE_ROWS], **{CACHE_KWARG: cache}, use_cache=True).logits.float())
    return torch.cat(out, dim=1)


def _estimate(model: nn.Module, targets: list[Target], options: dict[str, dict[str | None, nn.Module | None]],
              ids: torch.Tensor) -> tuple[dict[str, dict[str | None, float]], dict[str, float]]:
    """Each target's KL at each candidate level, estimated alone from one forward and backward of the unquantized
    model (the Fisher approximation ``KL ~ 1/2 E[(g . d)^2]``: ``d`` the level's output error on the layer's real
    input, ``g`` the gradient of the log-probability of a token drawn from the model's own distribution at that
    position, which makes the expectation the Fisher quadratic form). Also each target's input outlier ratio
    (largest ``|x|`` over the mean).

    Returns ``({layer: {level: nats/token}}, {layer: outlier ratio})``."""
    deltas: dict[str, dict[str | None, torch.Tensor]] = {}
    outliers: dict[str, float] = {}
    estimates: dict[str, dict[str | None, float]] = {}
    hooks = []

    def on_output(fqn: str):
        def hook(mod, args, out):
            x = args[0].detach()
            with torch.no_grad():
                y = out.detach().float()
                deltas[fqn] = {lv: (torch.zeros_like(y) if new is None else _in_rows(new, x).float() - y)
                               for lv, new in options[fqn].items()}
                ax = x.float().abs()
                outliers[fqn] = float(ax.amax() / ax.mean().clamp_min(1e-12))

            def on_grad(g):
                gf = g.detach().float()
                estimates[fqn] = {lv: 0.5 * float((gf * d).sum(-1).pow(2).mean()) for lv, d in deltas.pop(fqn).items()}

            if out.requires_grad:
                out.register_hook(on_grad)
        return hook

    def needs_grad(mod, args, out):  # the graph starts at the embedding: no weight needs a gradient
        return out.detach().requires_grad_(True)

    embed = model.get_input_embeddings()
    hooks.append(embed.register_forward_hook(needs_grad))
    for t in targets:
        hooks.append(t.module.register_forward_hook(on_output(t.fqn)))
    try:
        with torch.enable_grad():
            logits = model(ids, use_cache=False).logits.float()
            logp = F.log_softmax(logits, dim=-1)[0]  # [T, V]
            gen = torch.Generator().manual_seed(0)
            drawn = torch.multinomial(logp.detach().exp(), 1, generator=gen)  # [T, 1]
            logp.gather(-1, drawn).sum().backward()
    finally:
        for h in hooks:
            h.remove()
    return estimates, outliers


def _kl(logits: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    lp = F.log_softmax(logits.float(), dim=-1)
    lq = F.log_softmax(ref, dim=-1)
    kl = (lq.exp() * (lq - lp)).sum(-1).mean()
    top1 = (logits.argmax(-1) == ref.argmax(-1)).float().mean()
    return float(kl), float(top1)


class _Swapped:
    """Replacements put into the model without records (the fit's trial states); :meth:`restore` puts the
    originals back."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.originals: dict[str, nn.Module] = {}

    def put(self, fqn: str, new: nn.Module | None) -> None:
        if fqn not in self.originals:
            self.originals[fqn] = self.model.get_submodule(fqn)
        self.model.set_submodule(fqn, self.originals[fqn] if new is None else new)

    def restore(self) -> None:
        for fqn, old in self.originals.items():
            self.model.set_submodule(fqn, old)
        self.originals.clear()


def _levels_after(level: str | None, layer: nn.Module | None) -> list[str]:
    """The levels a layer built at ``level`` (as ``layer``) may still be raised to, mildest first."""
    start = 0 if level is None else KEEP_LEVELS.index(level) + 1
    out = []
    for lv in KEEP_LEVELS[start:]:
        if lv == "float-activations" and (layer is None or not int8_activations(layer)):
            continue  # no int8 activations to drop
        if lv == "int8" and type(layer).__name__ == "Int8Linear":
            continue  # already 8-bit (an int4 config's head)
        out.append(lv)
    return out


def _why(kl: dict[str | None, float], level: str | None, new: str, outlier: float) -> str:
    lost = f"alone it adds KL {kl[level]:.2g} as quantized, {kl[new]:.2g} as {new} (estimated)"
    if new == "float-activations":
        return f"{lost}; its input's largest value is {outlier:.0f}x the mean"
    return lost


def _order(estimates: dict[str, dict[str | None, float]], levels: dict[str, str | None]) -> list[tuple[str, str]]:
    """Every remedy ``(layer, level)``, the one with the largest estimated KL gain first, each layer's levels in
    order (a later level's gain counted from the one before it)."""
    current = dict(levels)
    pending = {fqn: [lv for lv in est if lv != levels[fqn]] for fqn, est in estimates.items()}
    order = []
    while True:
        best, gain = None, -float("inf")
        for fqn, todo in pending.items():
            if todo:
                g = max(estimates[fqn][current[fqn]] - estimates[fqn][lv] for lv in todo)
                if g > gain:
                    best, gain = fqn, g
        if best is None:
            return order
        # the mildest level with nearly the largest gain (8-bit weights rather than float when they remove as much)
        est = estimates[best]
        lv = next(v for v in pending[best] if est[current[best]] - est[v] >= _NEARLY * gain)
        pending[best] = [v for v in pending[best] if KEEP_LEVELS.index(v) > KEEP_LEVELS.index(lv)]
        current[best] = lv
        order.append((best, lv))


def fit_bound(model: nn.Module, config: StepConfig, *, tokenizer: Any = None, calibration: Any = None
              ) -> tuple[StepConfig, BoundFit, dict[str, nn.Module | None]]:
    """Measure ``config`` on ``model`` against its ``max_kl`` and keep in higher precision what breaks it.

    The model is unchanged when this returns (every trial swap is undone); :func:`infopt.quantize.quantize_` then
    applies the returned config, with the layers built here.

    Args:
        model: the unquantized model.
        config: a round-to-nearest quantize config with ``max_kl`` set.
        tokenizer: encodes the calibration text (default: the embedded default model's, for models sharing its
            vocabulary).
        calibration: text or ids to measure on instead of the built-in calibration text.

    Returns:
        ``(config with keep entries added, BoundFit, {layer: its built replacement, None for float})``.

    Raises:
        RecipeError: no usable measurement text (a tokenizer whose vocabulary does not fit the model: pass the
            model's own ``tokenizer=`` to :func:`infopt.optimize`).

    Example:
        >>> from infopt.models import tiny_model
        >>> from infopt.quantize import Int4WeightOnly
        >>> cfg, fit, layers = fit_bound(tiny_model(), Int4WeightOnly(group_size=32, max_kl=0.02))
        >>> fit.held, cfg.keep == tuple(f"{k}={v}" for k, v in fit.kept.items())
        (True, True)
    """
    t0 = time.perf_counter()
    bound = float(config.max_kl)
    try:
        ids = calibration_ids(model, calibration, tokenizer=tokenizer, samples=1, seq_len=BOUND_TOKENS)
    except RecipeError as e:
        raise RecipeError(f"{type(config).__name__}(max_kl={bound:g}) measures its error on calibration text: {e}. "
                          "Pass the model's own tokenizer (optimize(model, recipe, tokenizer=tok)), or max_kl: null "
                          "for no bound") from e
    info = inspect_model(model)
    head_fqn, embed_fqn = info.lm_head_fqn, info.embed_fqn
    targets = {t.fqn: t for t in quantize_targets(model, config)}
    share = bool(getattr(config, "share_embedding", False)) and head_tied(model, info)
    cache: dict[tuple[str, str | None], nn.Module | None] = {}

    def build(fqn: str, level: str | None) -> nn.Module | None:
        if (fqn, level) not in cache:
            t = targets[fqn]
            cfg = target_config(config, fqn, head_fqn, level)
            cache[(fqn, level)] = None if cfg is None else QUANTIZERS[type(cfg)](t.module, cfg, t.conv1d)
        return cache[(fqn, level)]

    levels: dict[str, str | None] = {fqn: keep_level(config, fqn) for fqn in targets}
    swapped = _Swapped(model)

    def measure(lv: dict[str, str | None]) -> tuple[float, float]:
        state = {fqn: build(fqn, level) for fqn, level in lv.items()}
        for fqn, new in state.items():
            swapped.put(fqn, new)
        if share:
            embed = swapped.originals.get(embed_fqn, model.get_submodule(embed_fqn))
            swapped.put(embed_fqn, shared_embedding(state.get(head_fqn), embed))
        with torch.inference_mode():
            return _kl(_logits_in_rows(model, ids), ref)

    with torch.inference_mode():
        ref = model(ids, use_cache=False).logits.float()
    final = dict(levels)
    try:
        kl0, top1 = measure(levels)
        fit = BoundFit(max_kl=bound, kl_quantized=kl0, kl=kl0, top1=top1, tokens=int(ids.shape[1]))
        if kl0 > bound:
            swapped.restore()
            options = {fqn: {lv: build(fqn, lv) for lv in (levels[fqn], *_levels_after(levels[fqn], build(fqn, levels[fqn])))}
                       for fqn in targets}
            estimates, outliers = _estimate(model, list(targets.values()), options, ids)
            order = _order(estimates, levels)

            def levels_for(k: int) -> dict[str, str | None]:
                lv = dict(levels)
                for fqn, level in order[:k]:
                    lv[fqn] = level
                return lv

            tried: dict[int, tuple[float, float]] = {0: (kl0, top1)}
            lo, hi, k = 0, len(order), 1
            while k < len(order):  # doubling: the first prefix that holds the bound
                tried[k] = measure(levels_for(k))
                if tried[k][0] <= bound:
                    hi = k
                    break
                lo, k = k, k * 2
            if hi not in tried:
                tried[hi] = measure(levels_for(hi))
            while hi - lo > 1 and tried[hi][0] <= bound:  # halving: the shortest prefix that holds it
                mid = (lo + hi) // 2
                tried[mid] = measure(levels_for(mid))
                if tried[mid][0] <= bound:
                    hi = mid
                else:
                    lo = mid
            fit.kl, fit.top1 = tried[hi]
            fit.tries = len(tried)
            final = levels_for(hi)
            for fqn, _ in order[:hi]:
                fit.kept[fqn] = final[fqn]
            fit.why = {fqn: _why(estimates[fqn], levels[fqn], lv, outliers.get(fqn, 0.0)) for fqn, lv in fit.kept.items()}
    finally:
        swapped.restore()
    fit.seconds = time.perf_counter() - t0
    keep = tuple(getattr(config, "keep", ())) + tuple(f"{fqn}={level}" for fqn, level in fit.kept.items())
    log.info("; ".join(fit.notes()))
    return dataclasses.replace(config, keep=keep), fit, {fqn: build(fqn, lv) for fqn, lv in final.items()}
