"""SmoothQuant W8A8: move activation outliers into the weights, then int8 weights x int8 per-token activations.

For each group of linears that read the same input (q/k/v; gate/up; o_proj; down_proj) the
calibrated per-channel activation maximum ``max|X_j|`` and the weights' per-input-channel maximum
``max|W_j|`` give a smoothing factor ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)``. The input is
divided by ``s`` and the weights' columns multiplied by it, which leaves the product unchanged in
exact arithmetic but flattens the activation outliers that per-token int8 quantization cannot hold.

Where the ``1/s`` goes, per input (all exact transformations, tested to 1e-4 on the logits):

- q/k/v and gate/up: folded into the norm before them. RMSNorm ``w * x``: ``w / s``. Gemma's
  ``(1 + w) * x``: ``w' = (1 + w) / s - 1``. GPT-2's LayerNorm ``g * x + b``: ``g / s`` and ``b / s``.
- o_proj: folded into the V rows of the attention (``v_proj``, the V slice of Phi-3's ``qkv_proj``
  or GPT-2's ``c_attn``, bias included), because attention is linear in V. With grouped-query
  attention one V channel feeds ``num_heads / num_kv_heads`` query heads, so ``s`` is shared by
  them (computed from the maximum over the heads).
- down_proj: folded into the up rows (``up_proj``, the second half of Phi-3's ``gate_up_proj``),
  because ``act(gate) * up`` is linear in ``up``.
- GPT-2's ``mlp.c_proj`` reads ``gelu(c_fc(x))``, which nothing linear precedes: its ``1/s`` stays
  inside the layer as an input multiply (the ``input_scale`` buffer of :class:`W8A8Linear`). The
  same fallback serves any group whose neighbours were already replaced by another quantizer.
"""

from __future__ import annotations

import copy
import numbers
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from tqdm.auto import tqdm  # widget bars in a notebook, text bars elsewhere

from ...core.errors import IncompatibleModelError
from ...core.introspect import FAMILIES, inspect_model, text_config
from ...core.patch import swap_module
from ...core.step import StepConfig, bad_field, register_step
from ..api import Target, quantize_targets, register_calibrated
from ..calibration.data import calibration_ids
from ..formats.w8a8 import W8A8Linear, int_mm_supported

__all__ = ["SmoothQuantW8A8", "SmoothGroup", "smooth_groups", "smooth_scales", "activation_absmax", "smooth_",
           "CALIBRATION_BATCH"]

CALIBRATION_BATCH = 4
"""Calibration rows per forward pass: small, so activations of a long calibration set never sit in memory at once."""

_ONE_PLUS_W = ("gemma", "gemma2", "gemma3_text")  # RMSNorm computes x * (1 + w)


@register_step
@dataclass(frozen=True)
class SmoothQuantW8A8(StepConfig):
    """SmoothQuant (Xiao et al., 2023): smoothed int8 weights x dynamic per-token int8 activations.

    Calibration runs the model over ``samples`` rows of ``seq_len`` tokens and records each
    linear group's per-channel activation maximum; the smoothing factors are folded into the
    layers before (see the module docstring), and every targeted linear becomes a
    :class:`~infopt.quantize.formats.w8a8.W8A8Linear` (``torch._int_mm`` where the device has it).

    Args:
        alpha: migration strength in [0, 1]: 0 puts all of the range on the activations side
            (``s = 1 / max|W|``), 1 all of it on the weights (``s = max|X|``); 0.5 balances them.
        samples: calibration rows (at most).
        seq_len: tokens per calibration row.

    Raises:
        RecipeError: alpha outside [0, 1], samples or seq_len not a positive integer.

    Example:
        >>> import torch, infopt
        >>> from infopt.models import tiny_model
        >>> m = infopt.optimize(tiny_model(), [SmoothQuantW8A8(samples=2, seq_len=16)],
        ...                     calibration=torch.randint(0, 1000, (2, 16)))
        >>> type(m.model.layers[0].self_attn.q_proj).__name__
        'W8A8Linear'
    """

    stage: ClassVar[str] = "quantize"
    kind: ClassVar[str] = "smoothquant"
    discriminator: ClassVar[str] = "method"
    alpha: float = 0.5
    samples: int = 32
    seq_len: int = 512

    def __post_init__(self):
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, numbers.Real) or not 0.0 <= float(a) <= 1.0:
            raise bad_field(self, "alpha", a, "a number in [0, 1] (0.5 balances activation and weight ranges)")
        for name in ("samples", "seq_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad_field(self, name, v, "an integer >= 1")

    def check(self, model: nn.Module, info, steps) -> list[str]:
        """Report (as fallbacks) the reasons ``torch._int_mm`` cannot serve the layers on this device."""
        reasons = set()
        for t in quantize_targets(model, self):
            out_f, in_f = t.weight.shape
            ok, reason = int_mm_supported(info.device, 32, in_f, out_f)
            if not ok:
                reasons.add(reason)
        return [f"W8A8 layers multiply their int8 values in a float matmul: {r}" for r in sorted(reasons)]


@dataclass(frozen=True)
class SmoothGroup:
    """Linears that read one input, and where their smoothing factors ``1/s`` can be folded.

    Attributes:
        consumers: dotted names of the linears reading the input.
        producer: dotted name of the module whose output is that input, or None.
        fold: ``rmsnorm`` (``w / s``), ``rmsnorm_1p`` (Gemma, ``(1 + w) / s - 1``), ``layernorm``
            (weight and bias ``/ s``), ``rows`` (the producer's output rows ``rows`` ``/ s``), or
            ``input`` (nothing to fold into: ``1/s`` stays an input multiply in the quantized layer).
        rows: for ``rows``: the producer's output rows ``[start, stop)`` that form the input.
        repeat: for ``rows``: consumer channel blocks of ``head_dim`` fed by each producer block
            (query heads per KV head); ``s`` is shared across them.
        head_dim: block width for ``repeat``.
    """

    consumers: tuple[str, ...]
    producer: str | None
    fold: str
    rows: tuple[int, int] = (0, 0)
    repeat: int = 1
    head_dim: int = 1


def _norm_fold(model_type: str, norm: nn.Module | None) -> str:
    if norm is None or getattr(norm, "weight", None) is None:
        return "input"
    if isinstance(norm, nn.LayerNorm):
        return "layernorm"
    if type(norm).__name__.endswith("RMSNorm"):
        return "rmsnorm_1p" if model_type in _ONE_PLUS_W else "rmsnorm"
    return "input"


def smooth_groups(model: nn.Module) -> list[SmoothGroup]:
    """The smoothing groups of every decoder layer, in model order (four per layer).

    Raises:
        IncompatibleModelError: unsupported architecture (from :func:`~infopt.core.introspect.inspect_model`).

    Example:
        >>> from infopt.models import tiny_model
        >>> [(g.consumers[-1].split(".")[-1], g.fold) for g in smooth_groups(tiny_model())[:4]]
        [('v_proj', 'rmsnorm'), ('o_proj', 'rows'), ('up_proj', 'rmsnorm'), ('down_proj', 'rows')]
    """
    info = inspect_model(model)
    fam = FAMILIES[info.model_type]
    tc = text_config(model.config)
    d, g_rep = info.head_dim, info.gqa_groups
    q_rows, kv_rows = info.num_heads * d, info.num_kv_heads * d
    out: list[SmoothGroup] = []

    def norm_group(consumers: tuple[str, ...], norm_fqn: str) -> SmoothGroup:
        norm = model.get_submodule(norm_fqn) if _has(model, norm_fqn) else None
        fold = _norm_fold(info.model_type, norm)
        return SmoothGroup(consumers, norm_fqn if fold != "input" else None, fold)

    for lf in info.layer_fqns:
        a, m = f"{lf}.{fam.attn}", f"{lf}.{fam.mlp}"
        if info.model_type == "gpt2":
            h = info.hidden_size
            out += [norm_group((f"{a}.c_attn",), f"{lf}.ln_1"),
                    SmoothGroup((f"{a}.c_proj",), f"{a}.c_attn", "rows", (2 * h, 3 * h), 1, d),
                    norm_group((f"{m}.c_fc",), f"{lf}.ln_2"),
                    SmoothGroup((f"{m}.c_proj",), None, "input")]
        elif info.model_type == "phi3":
            inter = int(tc.intermediate_size)
            out += [norm_group((f"{a}.qkv_proj",), f"{lf}.input_layernorm"),
                    SmoothGroup((f"{a}.o_proj",), f"{a}.qkv_proj", "rows", (q_rows + kv_rows, q_rows + 2 * kv_rows),
                                g_rep, d),
                    norm_group((f"{m}.gate_up_proj",), f"{lf}.post_attention_layernorm"),
                    SmoothGroup((f"{m}.down_proj",), f"{m}.gate_up_proj", "rows", (inter, 2 * inter))]
        else:  # llama-like: q/k/v/o, gate/up/down; Gemma 2/3 put pre_feedforward_layernorm before the MLP
            layer = model.get_submodule(lf)
            mlp_norm = "pre_feedforward_layernorm" if hasattr(layer, "pre_feedforward_layernorm") else \
                "post_attention_layernorm"
            inter = int(tc.intermediate_size)
            out += [norm_group((f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"), f"{lf}.input_layernorm"),
                    SmoothGroup((f"{a}.o_proj",), f"{a}.v_proj", "rows", (0, kv_rows), g_rep, d),
                    norm_group((f"{m}.gate_proj", f"{m}.up_proj"), f"{lf}.{mlp_norm}"),
                    SmoothGroup((f"{m}.down_proj",), f"{m}.up_proj", "rows", (0, inter))]
    return out


def _has(model: nn.Module, fqn: str) -> bool:
    try:
        model.get_submodule(fqn)
    except AttributeError:
        return False
    return True


def smooth_scales(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant factors ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)``.

    Channels whose activation (or weight column) maximum is 0 carry no information and keep ``s = 1``.

    Args:
        act_absmax: ``[in]`` per-channel maximum of ``|X|`` over the calibration tokens.
        weight_absmax: ``[in]`` per-input-channel maximum of ``|W|`` over every linear reading ``X``.
        alpha: migration strength in [0, 1].

    Returns:
        fp32 ``[in]``, positive.

    Example:
        >>> smooth_scales(torch.tensor([16.0, 1.0, 0.0]), torch.tensor([1.0, 4.0, 1.0]), 0.5).tolist()
        [4.0, 0.5, 1.0]
    """
    a = act_absmax.float()
    w = weight_absmax.float()
    s = a.clamp(min=1e-5).pow(alpha) / w.clamp(min=1e-5).pow(1.0 - alpha)
    s = s.clamp(min=1e-5)
    return torch.where((a > 0) & (w > 0), s, torch.ones_like(s))


def activation_absmax(model: nn.Module, ids: torch.Tensor, fqns: list[str] | tuple[str, ...], *,
                      batch_size: int = CALIBRATION_BATCH) -> dict[str, torch.Tensor]:
    """Per-input-channel ``max |X|`` of the modules ``fqns``, over a plain forward of ``ids``.

    The forward-pre hooks live only for this call (removed in ``finally``), so the model is left as it was.

    Args:
        model: the model.
        ids: token ids ``[n, seq]`` on the model's device.
        fqns: dotted names of the modules whose input to record.
        batch_size: rows per forward pass.

    Returns:
        ``{fqn: fp32 [in]}``.

    Raises:
        IncompatibleModelError: a module was never called during the forward.

    Example:
        >>> from infopt.models import tiny_model
        >>> m = tiny_model()
        >>> activation_absmax(m, torch.randint(0, 100, (2, 8)), ["model.layers.0.mlp.down_proj"])[
        ...     "model.layers.0.mlp.down_proj"].shape
        torch.Size([128])
    """
    stats: dict[str, torch.Tensor] = {}

    def make_hook(fqn: str):
        def hook(_mod, args):
            x = args[0].detach()
            amax = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()  # [in]
            prev = stats.get(fqn)
            stats[fqn] = amax if prev is None else torch.maximum(prev, amax)

        return hook

    handles = []
    try:
        for fqn in dict.fromkeys(fqns):
            handles.append(model.get_submodule(fqn).register_forward_pre_hook(make_hook(fqn)))
        with torch.no_grad():
            for i in tqdm(range(0, ids.shape[0], batch_size), desc="SmoothQuant calibration", unit="batch"):
                model(input_ids=ids[i:i + batch_size], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    missing = [f for f in fqns if f not in stats]
    if missing:
        raise IncompatibleModelError(
            f"SmoothQuant calibration never reached {', '.join(missing[:3])}; the model's forward does not call "
            "these layers, so they cannot be smoothed. Exclude them (exclude=[...])"
        )
    return stats


def _is_float_linear(mod: nn.Module) -> bool:
    is_lin = isinstance(mod, nn.Linear) or type(mod).__name__ == "Conv1D"
    return is_lin and mod.weight.dtype.is_floating_point


def _foldable(model: nn.Module, g: SmoothGroup) -> bool:
    if not all(_is_float_linear(model.get_submodule(c)) for c in g.consumers if _has(model, c)):
        return False
    if g.fold == "rows":
        return _is_float_linear(model.get_submodule(g.producer))
    return g.fold in ("rmsnorm", "rmsnorm_1p", "layernorm")


def _fold_norm(norm: nn.Module, s: torch.Tensor, fold: str) -> nn.Module:
    new = copy.deepcopy(norm)
    dtype = new.weight.dtype
    w = new.weight.detach().float()
    if fold == "rmsnorm_1p":  # y = x_hat * (1 + w)  ->  (1 + w') = (1 + w) / s
        w = (1.0 + w) / s - 1.0
    else:
        w = w / s
    new.weight.data = w.to(dtype)
    if fold == "layernorm" and new.bias is not None:  # y = x_hat * g + b: both scale with 1/s
        new.bias.data = (new.bias.detach().float() / s).to(new.bias.dtype)
    return new


def _float_copy(mod: nn.Module, w: torch.Tensor, b: torch.Tensor | None, conv1d: bool) -> nn.Module:
    # w: [out, in] fp32 working copy; Conv1D stores [in, out]
    new = copy.deepcopy(mod)
    new.weight.data = (w.t() if conv1d else w).contiguous().to(mod.weight.dtype)
    if b is not None:
        new.bias.data = b.to(mod.bias.dtype)
    return new


def _relevant_groups(model: nn.Module, targets: list[Target]) -> list[SmoothGroup]:
    names = {t.fqn for t in targets}
    return [g for g in smooth_groups(model) if any(c in names for c in g.consumers)]


def _plan(model: nn.Module, targets: list[Target], groups: list[SmoothGroup], alpha: float,
          stats: dict[str, torch.Tensor] | None, *, quantize: bool) -> dict[str, nn.Module]:
    """Replacements ``{fqn: module}``; ``stats`` None means rebuild (structure only)."""
    tmap = {t.fqn: t for t in targets}
    work: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}  # fqn -> (W [out, in] fp32, bias fp32)
    input_scales: dict[str, torch.Tensor | None] = {}
    norms: dict[str, nn.Module] = {}

    def weight(fqn: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        if fqn not in work:
            mod = model.get_submodule(fqn)
            w = mod.weight.detach()
            w = w.t() if type(mod).__name__ == "Conv1D" else w
            b = mod.bias.detach().float().clone() if mod.bias is not None else None
            work[fqn] = (w.float().clone(), b)
        return work[fqn]

    out: dict[str, nn.Module] = {}
    if stats is None:  # rebuild: only the structure matters; saved weights are loaded over it
        for g in groups:
            if not _foldable(model, g):
                input_scales.update((c, None) for c in g.consumers if c in tmap)
        for t in targets:
            w = t.weight
            out[t.fqn] = W8A8Linear(w.shape[1], w.shape[0], bias=t.module.bias is not None, dtype=w.dtype,
                                    input_scale=t.fqn in input_scales, device=w.device)
        return out

    def finish(fqn: str) -> None:
        # build the replacement as soon as no later group touches the layer: one layer's fp32 copies at a time
        w, b = work.pop(fqn)
        mod = model.get_submodule(fqn)
        conv1d = type(mod).__name__ == "Conv1D"
        if fqn in tmap and quantize:
            dtype = tmap[fqn].weight.dtype
            out[fqn] = W8A8Linear.from_weight(w, b, input_scale=input_scales.get(fqn), dtype=dtype)
        else:
            out[fqn] = _float_copy(mod, w, b, conv1d)

    last_use: dict[str, int] = {}
    for i, g in enumerate(groups):
        for name in (*g.consumers, g.producer):
            if name is not None:
                last_use[name] = i
    for i, g in enumerate(groups):
        fold = _foldable(model, g)
        if fold or quantize:  # float smoothing happens only where it folds exactly
            _smooth_group(model, g, fold, stats, alpha, tmap, weight, input_scales, norms)
        for name in [n for n, last in last_use.items() if last == i and n in work]:
            finish(name)
    for t in targets:
        if t.fqn not in out and quantize:  # in no group: plain W8A8
            weight(t.fqn)
            finish(t.fqn)
    out.update(norms)
    return out


def _smooth_group(model: nn.Module, g: SmoothGroup, fold: bool, stats: dict[str, torch.Tensor], alpha: float,
                  tmap: dict[str, Target], weight, input_scales: dict, norms: dict) -> None:
    """Compute ``s`` for one group and apply it to the working copies (and the norm it folds into)."""
    scaled = [c for c in g.consumers if _has(model, c) and (fold or c in tmap)]
    act = stats[g.consumers[0]]  # [in]
    wmax = torch.stack([weight(c)[0].abs().amax(dim=0) for c in scaled]).amax(dim=0)  # [in]
    if fold and g.fold == "rows" and g.repeat > 1:
        # GQA: channel [kv_head, rep, d] of the consumer input reads V row [kv_head, d]: share s over rep
        s_rows = smooth_scales(act.view(-1, g.repeat, g.head_dim).amax(dim=1).flatten(),
                               wmax.view(-1, g.repeat, g.head_dim).amax(dim=1).flatten(), alpha)
        s = s_rows.view(-1, 1, g.head_dim).expand(-1, g.repeat, g.head_dim).reshape(-1)
    else:
        s = s_rows = smooth_scales(act, wmax, alpha)
    for c in scaled:
        weight(c)[0].mul_(s[None, :])
    if not fold:
        for c in scaled:
            input_scales[c] = 1.0 / s
    elif g.fold == "rows":
        w, b = weight(g.producer)
        r0, r1 = g.rows
        w[r0:r1].div_(s_rows[:, None])
        if b is not None:
            b[r0:r1].div_(s_rows)
    else:
        norms[g.producer] = _fold_norm(model.get_submodule(g.producer), s, g.fold)


@register_calibrated(SmoothQuantW8A8)
def _plan_smoothquant(model: nn.Module, config: SmoothQuantW8A8, targets: list[Target], calibration: Any,
                      rebuild: bool) -> dict[str, nn.Module]:
    groups = _relevant_groups(model, targets)
    stats = None if rebuild else activation_absmax(model, calibration, [g.consumers[0] for g in groups])
    return _plan(model, targets, groups, float(config.alpha), stats, quantize=True)


def smooth_(model: nn.Module, calibration: Any = None, *, alpha: float = 0.5, samples: int = 32, seq_len: int = 512,
            tokenizer: Any = None, include: list[str] | tuple[str, ...] | None = None,
            exclude: list[str] | tuple[str, ...] | None = None, keep_original: str = "memory") -> nn.Module:
    """Apply SmoothQuant's smoothing alone, in float: outputs unchanged up to rounding, outliers moved into weights.

    Useful to inspect the smoothing, or to put another weight quantizer after it. Only groups that
    fold exactly into the layer before them are smoothed (GPT-2's ``mlp.c_proj`` is left as it is).
    Every change is recorded, so :func:`infopt.undo` restores the model bit for bit.

    Args:
        model: a supported causal LM.
        calibration: token ids ``[n, seq]`` or text (see :func:`infopt.quantize.calibration.data.calibration_ids`).
        alpha: migration strength in [0, 1].
        samples, seq_len: calibration rows and their length.
        tokenizer: encodes text calibration data.
        include / exclude: glob patterns on the linears' dotted names.
        keep_original: ``"memory"`` or ``"disk"`` (see :func:`infopt.core.patch.swap_module`).

    Returns:
        The same model.

    Raises:
        RecipeError: bad alpha/samples/seq_len or calibration data.
        IncompatibleModelError: unsupported architecture.

    Example:
        >>> from infopt.models import tiny_model
        >>> m = tiny_model()
        >>> ids = torch.randint(0, 1000, (2, 16))
        >>> ref = m(ids).logits
        >>> bool((smooth_(m, ids, seq_len=16)(ids).logits - ref).abs().max() < 1e-4)
        True
    """
    config = SmoothQuantW8A8(alpha=alpha, samples=samples, seq_len=seq_len)
    targets = quantize_targets(model, config, None, include, exclude)
    ids = calibration_ids(model, calibration, tokenizer=tokenizer, samples=samples, seq_len=seq_len)
    groups = [g for g in _relevant_groups(model, targets) if _foldable(model, g)]
    stats = activation_absmax(model, ids, [g.consumers[0] for g in groups])
    plan = _plan(model, targets, groups, float(alpha), stats, quantize=False)
    for fqn, new in plan.items():
        swap_module(model, fqn, new, step="smooth", keep_original=keep_original)
    return model
