"""AWQ (Lin et al., 2023): activation-aware per-input-channel scales, folded into the preceding op, before rounding.

For linears that read the same input ``x`` (q/k/v after the attention norm, gate/up after the MLP norm,
o_proj after v_proj, down_proj after up_proj) a scale ``s = mean|x|^alpha`` per input channel
(normalized so ``sqrt(max * min) = 1``) multiplies the weights' input columns and divides the op
that produced ``x``: ``(x / s) @ (W * s)^T == x @ W^T`` in exact arithmetic, but rounding ``W * s``
protects the columns that meet large activations. ``alpha`` is searched on a grid over ``[0, 1)``
(``alpha = 0`` is plain round-to-nearest) by the output error of the group's linears over all
calibration tokens (through ``X^T X``, so a try costs ``out * in^2`` whatever the token count), and the
best is kept.

Folding ``1 / s`` into the producer, per family:

- RMSNorm ``w * n(x)`` (Llama, Mistral, Qwen2/3, Phi-3): ``w /= s``.
- Gemma RMSNorm ``(1 + w) * n(x)`` (Gemma, Gemma 3): ``w = (1 + w) / s - 1`` (the offset kept).
- LayerNorm ``w * n(x) + b`` (GPT-2): ``w /= s`` and ``b /= s``.
- A linear producer (v_proj for o_proj, up_proj for down_proj; Phi-3's fused ``qkv_proj`` / ``gate_up_proj``
  and GPT-2's ``c_attn`` by their row slice): its output rows and bias divided by ``s``. With grouped-query
  attention one v row feeds several query heads' o_proj columns, so their scales are tied (the mean of
  the heads' activation magnitudes).

Which folds apply is decided before calibration, per layer, by a numerical check: fold random scales
into a float copy of the layer and keep a group only if the layer's output is unchanged. It needs no
data, so :func:`infopt.load_optimized` rebuilds the same modules. A group whose producer does not fold
(GPT-2's ``mlp.c_proj`` after GELU) is quantized without scales (round-to-nearest). Folded norms and
float producers that are not targets are returned in the plan as replacement modules, so the normal
swap/undo machinery restores them. The clipping search of the AWQ paper is not implemented.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ...core.introspect import ModelInfo, inspect_model
from ...core.step import StepConfig, bad_field, register_step
from ..api import Target, register_calibrated
from .layerwise import (
    Grid,
    LayerRunner,
    build_quantized,
    capture_layer_calls,
    check_calibrated_config,
    check_calibrated_model,
    get_weight,
    group_size_for,
    quantize_layerwise,
    set_weight,
    targets_by_layer,
)

__all__ = ["AWQ", "ScaleGroup", "awq_plan"]

@register_step
@dataclass(frozen=True)
class AWQ(StepConfig):
    """Activation-aware weight quantization: per-channel scales searched on calibration data, folded into the
    preceding norm or linear, then grouped round-to-nearest (4-bit ``Int4Linear`` or 8-bit ``Int8Linear``).

    Args:
        bits: 4 (grouped codes 0..15 with scales and zero points) or 8 (symmetric int8).
        group_size: input channels per scale (32, 64, 128, 256; -1 = one per output row, 8 bits only). It
            must divide every quantized layer's ``in_features`` (the default model's 576 takes 64 or 32).
        samples: calibration sequences (at most).
        seq_len: tokens per calibration sequence (at most the model's context).
        grid: number of ``alpha`` values tried, ``k / grid`` for ``k = 0 .. grid - 1``.
        symmetric: 4-bit zero point fixed at 8 instead of fitted per group (8 bits are always symmetric).

    Raises:
        RecipeError: a field out of range.

    Example:
        >>> import torch
        >>> from infopt.models import tiny_model
        >>> from infopt.quantize import quantize_
        >>> ids = torch.randint(0, 49152, (4, 32), generator=torch.Generator().manual_seed(0))
        >>> m = quantize_(tiny_model(), AWQ(group_size=32, samples=4, seq_len=32), calibration=ids)
        >>> type(m.model.layers[0].mlp.up_proj).__name__, type(m.model.layers[0].input_layernorm).__name__
        ('Int4Linear', 'LlamaRMSNorm')
    """

    stage: ClassVar[str] = "quantize"
    kind: ClassVar[str] = "awq"
    discriminator: ClassVar[str] = "method"
    bits: int = 4
    group_size: int = 128
    samples: int = 64
    seq_len: int = 512
    grid: int = 20
    symmetric: bool = False

    def __post_init__(self):
        check_calibrated_config(self)
        if not isinstance(self.grid, int) or isinstance(self.grid, bool) or self.grid <= 0:
            raise bad_field(self, "grid", self.grid, "a positive integer (alpha values tried), e.g. 20")

    def check(self, model, info, steps):
        check_calibrated_model(self, model)
        return []


@dataclass(frozen=True)
class ScaleGroup:
    """Linears sharing one input, and the op producing that input (names relative to a decoder layer).

    Attributes:
        prev: the producer: a norm, or a linear whose output rows ``rows`` (all when None) are the input.
        linears: the consumers; their input columns are scaled.
        tie: ``(kv_heads, groups, head_dim)`` when one producer channel feeds ``groups`` consumer channels
            (v_proj -> o_proj under grouped-query attention); ``groups`` is 1 otherwise.
        fold: ``"scale"`` (``w /= s``, and ``b``), ``"offset"`` (``w = (1 + w) / s - 1``) for a norm, or
            ``"rows"`` for a linear producer.
    """

    prev: str
    linears: tuple[str, ...]
    rows: tuple[int, int] | None = None
    tie: tuple[int, int, int] | None = None
    fold: str = "rows"


def _is_linear(mod: nn.Module) -> bool:
    return isinstance(mod, nn.Linear) or type(mod).__name__ == "Conv1D"


def _conv1d(mod: nn.Module) -> bool:
    return type(mod).__name__ == "Conv1D"


def _candidates(info: ModelInfo, layer: nn.Module) -> list[ScaleGroup]:
    heads, kv, hd = info.num_heads, info.num_kv_heads, info.head_dim
    tie = (kv, heads // max(1, kv), hd)
    if info.model_type == "gpt2":
        h = info.hidden_size
        return [ScaleGroup("ln_1", ("attn.c_attn",)),
                ScaleGroup("attn.c_attn", ("attn.c_proj",), rows=(2 * h, 3 * h), tie=(heads, 1, hd)),
                ScaleGroup("ln_2", ("mlp.c_fc",))]  # mlp.c_proj reads GELU output: no fold
    if info.model_type == "phi3":
        q, k = heads * hd, kv * hd
        inter = layer.mlp.down_proj.in_features
        return [ScaleGroup("input_layernorm", ("self_attn.qkv_proj",)),
                ScaleGroup("self_attn.qkv_proj", ("self_attn.o_proj",), rows=(q + k, q + 2 * k), tie=tie),
                ScaleGroup("post_attention_layernorm", ("mlp.gate_up_proj",)),
                ScaleGroup("mlp.gate_up_proj", ("mlp.down_proj",), rows=(inter, 2 * inter))]
    mlp_norm = "pre_feedforward_layernorm" if hasattr(layer, "pre_feedforward_layernorm") else "post_attention_layernorm"
    return [ScaleGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ScaleGroup("self_attn.v_proj", ("self_attn.o_proj",), tie=tie),
            ScaleGroup(mlp_norm, ("mlp.gate_proj", "mlp.up_proj")),
            ScaleGroup("mlp.up_proj", ("mlp.down_proj",))]


def _expand(g: ScaleGroup, s_prev: torch.Tensor) -> torch.Tensor:
    # s_prev: [kv * hd] per producer channel -> [kv * groups * hd] per consumer input channel
    if g.tie is None or g.tie[1] == 1:
        return s_prev
    kv, groups, hd = g.tie
    return s_prev.view(kv, 1, hd).expand(kv, groups, hd).reshape(-1)


def _reduce(g: ScaleGroup, per_input: torch.Tensor) -> torch.Tensor:
    # per consumer input channel -> per producer channel (mean over the query heads sharing a kv head)
    if g.tie is None or g.tie[1] == 1:
        return per_input
    kv, groups, hd = g.tie
    return per_input.view(kv, groups, hd).mean(1).reshape(-1)


def _apply(layer: nn.Module, g: ScaleGroup, s_prev: torch.Tensor) -> None:
    """Fold ``s`` into ``layer`` in place: consumers' input columns ``*= s``, producer ``/= s``."""
    s_in = _expand(g, s_prev)
    with torch.no_grad():
        for rel in g.linears:
            mod = layer.get_submodule(rel)
            set_weight(mod, get_weight(mod, _conv1d(mod)) * s_in[None, :], _conv1d(mod))
        prev = layer.get_submodule(g.prev)
        if g.fold == "rows":
            w = get_weight(prev, _conv1d(prev))
            r0, r1 = g.rows or (0, w.shape[0])
            w[r0:r1] /= s_prev[:, None]
            set_weight(prev, w, _conv1d(prev))
            if getattr(prev, "bias", None) is not None:
                prev.bias[r0:r1] /= s_prev.to(prev.bias.dtype)
        elif g.fold == "scale":
            prev.weight.copy_((prev.weight.float() / s_prev).to(prev.weight.dtype))
            if getattr(prev, "bias", None) is not None:
                prev.bias.copy_((prev.bias.float() / s_prev).to(prev.bias.dtype))
        else:  # "offset": (1 + w) * n(x)
            prev.weight.copy_(((1.0 + prev.weight.float()) / s_prev - 1.0).to(prev.weight.dtype))


def _fits(layer: nn.Module, g: ScaleGroup) -> bool:
    try:
        prev = layer.get_submodule(g.prev)
        mods = [layer.get_submodule(rel) for rel in g.linears]
    except AttributeError:
        return False
    if not all(_is_linear(m) for m in mods):
        return False
    n_in = {get_weight(m, _conv1d(m)).shape[1] for m in mods}
    if len(n_in) != 1:
        return False
    if _is_linear(prev):
        out = get_weight(prev, _conv1d(prev)).shape[0]
        width = (g.rows[1] - g.rows[0]) if g.rows else out
    else:
        w = getattr(prev, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 1:
            return False
        width = w.numel()
    groups = g.tie[1] if g.tie else 1
    return width * groups == n_in.pop()


def structure(model: nn.Module, info: ModelInfo, by_layer: dict[int, dict[str, Target]]) -> dict[int, list[ScaleGroup]]:
    """The foldable scale groups of each layer with targets (all consumers must be targets), decided without
    data: random scales are folded into a copy of the layer and kept only if its output does not change."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, info.vocab_size, (1, 16), generator=gen).to(info.device)
    hidden, calls = capture_layer_calls(model, info, ids)
    tol = 1e-3 if info.dtype == torch.float32 else 5e-2
    out: dict[int, list[ScaleGroup]] = {}
    for i, targets in by_layer.items():
        layer = model.get_submodule(info.layer_fqns[i])
        work = copy.deepcopy(layer)

        def run(mod, h=hidden[i], call=calls[i]):
            with torch.no_grad():
                y = mod(h, *call.args, **call.kwargs)
            return (y[0] if isinstance(y, tuple) else y).float()

        ref = run(work)
        saved = {k: v.clone() for k, v in work.state_dict().items()}
        kept = []
        for g in _candidates(info, layer):
            if not all(rel in targets for rel in g.linears) or not _fits(work, g):
                continue
            prev = work.get_submodule(g.prev)
            width = (g.rows[1] - g.rows[0]) if g.rows else (
                get_weight(prev, _conv1d(prev)).shape[0] if _is_linear(prev) else prev.weight.numel())
            s = torch.exp(torch.rand(width, generator=gen) * 2 - 1).to(info.device)
            for fold in (("rows",) if _is_linear(prev) else ("scale", "offset")):
                cand = ScaleGroup(g.prev, g.linears, g.rows, g.tie, fold)
                _apply(work, cand, s)
                err = float((run(work) - ref).norm() / ref.norm().clamp(min=1e-12))
                work.load_state_dict(saved)
                if err < tol:
                    kept.append(cand)
                    break
        out[i] = kept
    return out


def _search(g: ScaleGroup, h: torch.Tensor, x_mean: torch.Tensor, weights: list[torch.Tensor], grid: Grid,
            group_size: int, n_grid: int) -> torch.Tensor:
    """The best producer-side scale ``[width]`` for group ``g``.

    ``h`` ``[in, in]`` is ``X^T X / N`` over all calibration tokens and ``x_mean`` ``[in]`` their mean ``|x|``;
    ``weights`` are the consumers' ``[out, in]`` float weights. The output error of a weight change ``dW`` is
    ``mean((X dW^T)^2) = sum((dW h) * dW) / out``: exact over every token, at ``out * in^2`` per try
    instead of ``N * out * in``.
    """
    mag = _reduce(g, x_mean)
    best, best_s = float("inf"), torch.ones_like(mag)
    for k in range(n_grid):
        alpha = k / n_grid
        s = mag.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        s_in = _expand(g, s)
        loss = 0.0
        for w in weights:
            gs = group_size if group_size > 0 else w.shape[1]
            dw = grid.dequantize(*grid.rtn(w * s_in[None, :], gs), gs) / s_in[None, :] - w  # [out, in]
            loss += float(((dw @ h) * dw).sum()) / w.shape[0]
        if loss < best:
            best, best_s = loss, s
    return best_s


def _layer_fn(config: AWQ, dtype: torch.dtype, groups: dict[int, list[ScaleGroup]], quantize: bool):
    grid = Grid(config.bits, config.symmetric)

    def run(index: int, work: nn.Module, runner: LayerRunner, targets: dict[str, Target]) -> dict[str, nn.Module]:
        layer_groups = groups.get(index, [])
        taps = {g.linears[0]: work.get_submodule(g.linears[0]) for g in layer_groups}
        abs_sum: dict[str, torch.Tensor] = {}
        hess: dict[str, torch.Tensor] = {}
        count: dict[str, int] = {}

        def on_input(rel: str, x: torch.Tensor) -> None:
            x2 = x.reshape(-1, x.shape[-1]).float()  # [tokens, in]
            if rel not in hess:
                abs_sum[rel] = torch.zeros(x2.shape[1], device=x2.device)
                hess[rel] = torch.zeros(x2.shape[1], x2.shape[1], device=x2.device)
                count[rel] = 0
            abs_sum[rel] += x2.abs().sum(0)
            hess[rel].addmm_(x2.t(), x2)
            count[rel] += x2.shape[0]

        if taps:
            runner.run(work, taps, on_input)
        for g in layer_groups:
            head = g.linears[0]
            n = count[head]
            weights = [get_weight(m, _conv1d(m)) for m in (work.get_submodule(rel) for rel in g.linears)]
            s = _search(g, hess.pop(head) / n, abs_sum[head] / n, weights, grid, config.group_size, config.grid)
            _apply(work, g, s)
        out: dict[str, nn.Module] = {}
        for g in layer_groups:
            if g.prev not in targets:  # folded norm, or a float producer left unquantized
                out[g.prev] = work.get_submodule(g.prev)
        for rel, t in targets.items():
            mod = work.get_submodule(rel)
            if not quantize:
                out[rel] = mod
                continue
            w = get_weight(mod, t.conv1d)
            gs = group_size_for(config, w.shape[1])
            codes, scales, zeros = grid.rtn(w, gs)
            out[rel] = build_quantized(grid, codes, scales, zeros, group_size=gs, bias=getattr(mod, "bias", None),
                                       dtype=dtype, per_channel=config.group_size == -1)
            set_weight(mod, grid.dequantize(codes, scales, zeros, gs), t.conv1d)
        return out

    return run


def awq_plan(model: nn.Module, config: AWQ, targets: list[Target], calibration: torch.Tensor | None, *,
             rebuild: bool = False, quantize: bool = True) -> dict[str, nn.Module]:
    """Build AWQ's replacements ``{fqn: module}`` without touching ``model``.

    Args:
        model: the model.
        config: the AWQ config.
        targets: from :func:`infopt.quantize.api.quantize_targets`.
        calibration: token ids ``[n, S]`` (None with ``rebuild``).
        rebuild: only the structure (RTN codes, copies of the norms to fold into) for loading saved weights.
        quantize: False returns the scaled float linears instead of quantized ones: swapped in, the model
            computes the same function as before (what the fold must guarantee; tests check it).

    Returns:
        Replacements for the targets and for every norm or producer linear a scale was folded into.
    """
    info = inspect_model(model)
    groups = structure(model, info, targets_by_layer(info, targets))
    if rebuild:
        grid = Grid(config.bits, config.symmetric)
        out: dict[str, nn.Module] = {}
        by_fqn = {t.fqn: t for t in targets}
        for i, gs_ in groups.items():
            for g in gs_:
                fqn = f"{info.layer_fqns[i]}.{g.prev}"
                if fqn not in by_fqn:
                    out[fqn] = copy.deepcopy(model.get_submodule(fqn))
        for t in targets:
            w = t.weight.float()
            gs = group_size_for(config, w.shape[1])
            out[t.fqn] = build_quantized(grid, *grid.rtn(w, gs), group_size=gs, bias=getattr(t.module, "bias", None),
                                         dtype=info.dtype, per_channel=config.group_size == -1)
        return out
    return quantize_layerwise(model, targets, calibration, _layer_fn(config, info.dtype, groups, quantize),
                              desc="AWQ")


@register_calibrated(AWQ)
def _plan(model: nn.Module, config: AWQ, targets: list[Target], calibration: torch.Tensor | None,
          rebuild: bool) -> dict[str, nn.Module]:
    return awq_plan(model, config, targets, calibration, rebuild=rebuild)
