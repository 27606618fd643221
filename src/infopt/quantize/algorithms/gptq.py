"""GPTQ (Frantar et al., 2022): weights rounded column by column, each rounding error spread over the columns
not yet rounded through the inverse Hessian of the layer's calibration inputs.

For a linear layer with calibration inputs ``X`` ``[N, in]`` the Hessian of the output error is
``H = 2 X^T X / N``. The algorithm rounds weight columns in order (by descending ``diag(H)`` with
``act_order``), and after each column moves its rounding error onto the remaining columns along the
rows of the upper Cholesky factor of ``H^-1``; updates to columns past the current block of 128 are
applied lazily, one matmul per block.

Storage with ``act_order`` (4 bits): groups are formed over consecutive columns *in the processing
order* (the reference implementation's ``desc_act``), with scales fitted on the error-updated weights
when a group starts. The codes are stored in that permuted column order, so each group is contiguous
as the int4 kernels need, and ``Int4Linear`` keeps the permutation as ``in_perm`` (int64 ``[in]``) and
gathers ``x[..., in_perm]`` before the matmul: one extra read and write of the activations per call
(``in`` elements per token, negligible beside the weight read at decode, a few percent of a prefill
matmul). q/k/v (and gate/up) share one Hessian, hence one permutation. With 8 bits, ``Int8Linear`` has
no permutation, so ``act_order`` uses "static groups": scales are fitted per group in the original
column order before rounding starts, and the codes are un-permuted afterwards (one scale per row with
``group_size=-1`` makes the order irrelevant).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ...core.introspect import inspect_model
from ...core.step import StepConfig, bad_field, register_step
from ..api import Target, register_calibrated
from ..formats.primitives import dequantize
from .layerwise import (
    Grid,
    LayerRunner,
    build_quantized,
    check_calibrated_config,
    check_calibrated_model,
    get_weight,
    group_size_for,
    quantize_layerwise,
    set_weight,
)

__all__ = ["GPTQ", "GPTQResult", "gptq_quantize"]


@register_step
@dataclass(frozen=True)
class GPTQ(StepConfig):
    """Calibrated weight-only quantization with GPTQ error compensation (4-bit ``Int4Linear`` or 8-bit ``Int8Linear``).

    Args:
        bits: 4 (grouped codes 0..15 with scales and zero points) or 8 (symmetric int8).
        group_size: input channels per scale (32, 64, 128, 256; -1 = one scale per output row, 8 bits
            only). It must divide every quantized layer's ``in_features`` (the default model's 576
            takes 64 or 32, not 128).
        damp: dampening added to ``diag(H)``, as a fraction of its mean, in (0, 1).
        act_order: round columns by descending Hessian diagonal (the most activated inputs first);
            usually lower error. 4-bit layers then store an input permutation (see the module docs).
        samples: calibration sequences (at most).
        seq_len: tokens per calibration sequence (at most the model's context).
        symmetric: 4-bit zero point fixed at 8 instead of fitted per group (8 bits are always symmetric).

    Raises:
        RecipeError: a field out of range.

    Example:
        >>> import torch
        >>> from infopt.models import tiny_model
        >>> from infopt.quantize import quantize_
        >>> m = tiny_model()
        >>> ids = torch.randint(0, 49152, (4, 32), generator=torch.Generator().manual_seed(0))
        >>> m = quantize_(m, GPTQ(group_size=32, samples=4, seq_len=32), calibration=ids)
        >>> type(m.model.layers[0].mlp.up_proj).__name__
        'Int4Linear'
    """

    stage: ClassVar[str] = "quantize"
    kind: ClassVar[str] = "gptq"
    discriminator: ClassVar[str] = "method"
    bits: int = 4
    group_size: int = 128
    damp: float = 0.01
    act_order: bool = True
    samples: int = 128
    seq_len: int = 512
    symmetric: bool = False

    def __post_init__(self):
        check_calibrated_config(self)
        if isinstance(self.damp, bool) or not isinstance(self.damp, (int, float)) or not 0 < self.damp < 1:
            raise bad_field(self, "damp", self.damp, "a number in (0, 1), e.g. 0.01")
        if not isinstance(self.act_order, bool):
            raise bad_field(self, "act_order", self.act_order, "true or false")

    def check(self, model, info, steps):
        check_calibrated_model(self, model)
        return []


@dataclass
class GPTQResult:
    """One layer quantized by :func:`gptq_quantize`.

    Attributes:
        codes: ``[out, in]`` float codes 0..maxq in the stored column order (``perm`` applied when not None).
        scales, zeros: ``[out, in // group_size]`` fp32 (zeros hold integers).
        perm: ``[in]`` int64 input permutation of the stored columns, or None (original order).
        weight: the dequantized ``[out, in]`` fp32 weight in the original column order.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    perm: torch.Tensor | None
    weight: torch.Tensor


def _inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    # h: [in, in] -> upper Cholesky factor of (h + damp * mean(diag h) * I)^-1, raising damp until it factors
    eye = torch.eye(h.shape[0], dtype=torch.float64, device=h.device)
    h64 = h.double()
    lam = damp * float(torch.diag(h64).mean())
    for _ in range(6):
        chol, info = torch.linalg.cholesky_ex(h64 + lam * eye)
        if int(info) == 0:
            hinv = torch.cholesky_inverse(chol)
            return torch.linalg.cholesky(hinv, upper=True).float()
        lam *= 10
    raise RuntimeError("GPTQ: the Hessian is not positive definite even with 10^5x dampening; raise damp")


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, *, bits: int = 4, group_size: int = 128, damp: float = 0.01,
                  act_order: bool = True, symmetric: bool = False, static_groups: bool = False,
                  block_size: int = 128) -> GPTQResult:
    """Quantize one weight matrix with GPTQ.

    Args:
        w: ``[out, in]`` weight.
        h: ``[in, in]`` Hessian ``2 X^T X / N`` of the layer's inputs.
        bits: 4 or 8 (see :class:`Grid`).
        group_size: input channels per group (``in`` for one group per row); divides ``in``.
        damp: fraction of ``mean(diag(h))`` added to the diagonal.
        act_order: process columns by descending ``diag(h)``.
        symmetric: 4-bit zero point fixed at 8.
        static_groups: fit every group's grid on the original weights, in the original column order, before
            rounding (needed to store ``act_order`` results without a permutation).
        block_size: columns per lazy-update block (rounded up to a multiple of ``group_size``).

    Returns:
        :class:`GPTQResult`; ``perm`` is set only for ``act_order`` without static groups (and more than one group).

    Example:
        >>> x = torch.randn(256, 64) @ torch.randn(64, 64)  # correlated inputs
        >>> w = torch.randn(32, 64)
        >>> r = gptq_quantize(w, 2 * x.T @ x / 256, group_size=32)
        >>> rtn = Grid(4).rtn(w, 32)
        >>> err = lambda v: float((x @ (v - w).T).pow(2).mean())
        >>> err(r.weight) < err(Grid(4).dequantize(*rtn, 32))
        True
    """
    grid = Grid(bits, symmetric)
    W = w.detach().float().clone()  # [out, in]
    H = h.detach().float().clone()  # [in, in]
    out_f, in_f = W.shape
    gs = group_size
    n_groups = in_f // gs
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    upfront = static_groups or n_groups == 1
    if upfront:  # grid fitted once on the original weights, per group in the original column order
        g_scale, g_zero = grid.fit(W.reshape(out_f, n_groups, gs))  # [out, G]
    perm = None
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        W = W[:, perm]
        H = H[perm][:, perm]
    hinv = _inverse_cholesky(H, damp)
    del H
    # upfront grids: each processed column's group in the original order, read once to the host (not one device
    # sync per column on CUDA)
    group_of = (perm // gs).tolist() if upfront and perm is not None else None

    codes = torch.zeros_like(W)
    scales = g_scale.clone() if upfront else torch.zeros(out_f, n_groups, device=W.device)
    zeros = g_zero.clone() if upfront else torch.zeros(out_f, n_groups, device=W.device)
    deq = torch.zeros_like(W)
    block = block_size if upfront else gs * -(-block_size // gs)  # groups never straddle a block
    for i1 in range(0, in_f, block):
        i2 = min(i1 + block, in_f)
        w1 = W[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if upfront:
                g = group_of[col] if group_of is not None else col // gs
                scale, zero = g_scale[:, g], g_zero[:, g]
            elif col % gs == 0:  # a new group: fit on its error-updated columns
                scale, zero = grid.fit(w1[:, i:i + gs])
                scales[:, col // gs], zeros[:, col // gs] = scale, zero
            wc = w1[:, i]
            q = grid.quantize(wc, scale, zero)
            dq = dequantize(q, (1,), scale, zero)  # [out]
            codes[:, col], deq[:, col] = q, dq
            e = (wc - dq) / hinv1[i, i]
            w1[:, i:] -= e[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = e
        W[:, i2:] -= err1 @ hinv[i1:i2, i2:]

    if perm is not None:
        weight = torch.empty_like(deq)
        weight[:, perm] = deq
        if upfront:  # groups live in the original order: store the codes there too
            c = torch.empty_like(codes)
            c[:, perm] = codes
            codes, perm = c, None
    else:
        weight = deq
    return GPTQResult(codes, scales, zeros, perm, weight)


def _layer_fn(config: GPTQ, dtype: torch.dtype):
    grid = Grid(config.bits, config.symmetric)

    def run(index: int, work: nn.Module, runner: LayerRunner, targets: dict[str, Target]) -> dict[str, nn.Module]:
        mods = {rel: work.get_submodule(rel) for rel in targets}
        hess: dict[str, torch.Tensor] = {}
        rows: dict[str, int] = {}
        alias: dict[str, str] = {}  # q/k/v read one tensor: one Hessian
        recent: list[tuple[torch.Tensor, str]] = []

        def on_input(rel: str, x: torch.Tensor) -> None:
            for other_x, other in recent:
                if other_x is x:
                    alias[rel] = other
                    return
            recent.append((x, rel))
            del recent[:-len(targets)]
            x2 = x.reshape(-1, x.shape[-1]).float()  # [tokens, in]
            if rel not in hess:
                hess[rel] = torch.zeros(x2.shape[1], x2.shape[1], device=x2.device)
                rows[rel] = 0
            hess[rel].addmm_(x2.t(), x2)
            rows[rel] += x2.shape[0]

        runner.run(work, mods, on_input)
        recent.clear()
        out = {}
        for rel, t in targets.items():
            owner = alias.get(rel, rel)
            h = hess[owner] * (2.0 / rows[owner])
            w = get_weight(mods[rel], t.conv1d)
            gs = group_size_for(config, w.shape[1])
            r = gptq_quantize(w, h, bits=config.bits, group_size=gs, damp=config.damp, act_order=config.act_order,
                              symmetric=config.symmetric, static_groups=config.act_order and config.bits == 8)
            bias = getattr(mods[rel], "bias", None)
            out[rel] = build_quantized(grid, r.codes, r.scales, r.zeros, group_size=gs, bias=bias, dtype=dtype,
                                       in_perm=r.perm, per_channel=config.group_size == -1)
            set_weight(mods[rel], r.weight, t.conv1d)  # the next layer calibrates on quantized activations
        return out

    return run


def _rebuild(config: GPTQ, targets: list[Target], dtype: torch.dtype) -> dict[str, nn.Module]:
    # structure only (saved weights are loaded over it): RTN codes, and an in_perm buffer where GPTQ stores one
    grid = Grid(config.bits, config.symmetric)
    out = {}
    for t in targets:
        w = t.weight.float()
        gs = group_size_for(config, w.shape[1])
        codes, scales, zeros = grid.rtn(w, gs)
        perm = None
        if config.act_order and config.bits == 4 and gs < w.shape[1]:
            perm = torch.arange(w.shape[1], device=w.device)
        out[t.fqn] = build_quantized(grid, codes, scales, zeros, group_size=gs, bias=getattr(t.module, "bias", None),
                                     dtype=dtype, in_perm=perm, per_channel=config.group_size == -1)
    return out


@register_calibrated(GPTQ)
def _plan(model: nn.Module, config: GPTQ, targets: list[Target], calibration: torch.Tensor | None,
          rebuild: bool) -> dict[str, nn.Module]:
    dtype = inspect_model(model).dtype
    if rebuild:
        return _rebuild(config, targets, dtype)
    return quantize_layerwise(model, targets, calibration, _layer_fn(config, dtype), desc="GPTQ")
