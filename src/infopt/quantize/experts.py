"""Weight-only quantization of mixture-of-experts experts: one quantized linear per expert and projection.

transformers v5 keeps a block's experts as one module with 3D weights, ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]`` (see :mod:`infopt.core.moe`). :class:`QuantizedExperts` replaces that module with
``E`` quantized ``gate_up`` and ``E`` quantized ``down`` layers built by the config's own layer quantizer
(:class:`~infopt.quantize.formats.int8.Int8Linear` or :class:`~infopt.quantize.formats.int4.Int4Linear`), so every expert
has its own per-channel (int8) or per-group (int4) scales and runs the same kernels as a dense layer. The
router (``gate``) and the shared expert's sigmoid gate are never touched: routing is decided in the
model's precision. The forward keeps transformers' contract ``forward(x [T, H], top_k_index [T, k],
top_k_weights [T, k]) -> [T, H]``, so the block's own routing code runs unchanged.

Under ``torch.compile`` the expert dispatch is one opaque custom op, ``infopt::quantized_experts``: how many tokens
each expert gets is known only when the router has run, so dynamo cannot trace the per-expert loop into a graph
(``bincount`` and each expert's slice have data-dependent sizes, which fail a ``fullgraph`` trace). The op runs the
same eager loop inside the compiled decode step, so a compiled step reads only the routed experts' weights and
gives the eager step's numbers, and the rest of the layer (attention, router, shared expert) is compiled around it.
transformers opaques its ``grouped_mm`` fallback the same way.

Saved (``state_dict``): ``gate_up_proj.<e>.*`` and ``down_proj.<e>.*``, each expert's tensors in its layer
kind's portable layout. ``infopt.save_optimized`` / ``infopt.load_optimized`` round-trip it bit for bit;
``save_pretrained`` refuses such a model with a :class:`~infopt.core.errors.CheckpointError` (transformers converts
expert tensors into its checkpoint layout as it saves, which per-expert quantized layers do not have).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import nn

from ..core.errors import IncompatibleModelError
from ..core.moe import moe_blocks
from ..ops.experts import QUANTIZED_EXPERTS as _LIVE

__all__ = ["QuantizedExperts", "EXPERT_QUANTIZERS", "register_experts_quantizer", "experts_targets",
           "check_experts_shapes"]



class QuantizedExperts(nn.Module):
    """A block's experts as ``E`` quantized ``gate_up`` layers (``[2I, H]`` each) and ``E`` ``down`` layers
    (``[H, I]``), computing ``down_e(act(gate) * up)`` for the tokens routed to expert ``e``.

    Build with :meth:`from_experts`. ``is_infopt_experts`` marks it for :func:`infopt.core.moe.moe_blocks`.
    """

    is_infopt_experts = True

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module], act_fn: Callable, *, hidden_dim: int,
                 intermediate_dim: int):
        super().__init__()
        if len(gate_up) != len(down) or not gate_up:
            raise ValueError(f"QuantizedExperts: {len(gate_up)} gate_up and {len(down)} down layers; need the same "
                             "positive number")
        self.num_experts = len(gate_up)
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.gate_up_proj = nn.ModuleList(gate_up)
        self.down_proj = nn.ModuleList(down)
        self.act_fn = act_fn
        self._handle = _LIVE.register(self)  # names this module to infopt::quantized_experts in compiled graphs

    def __setstate__(self, state):
        super().__setstate__(state)
        # a copy (deepcopy, pickle) gets a handle of its own: its compiled graphs must reach its own weights
        self._handle = _LIVE.register(self)

    @classmethod
    def from_experts(cls, experts: nn.Module, make: Callable[[nn.Module], nn.Module]) -> QuantizedExperts:
        """Quantize a transformers experts module (3D ``gate_up_proj`` / ``down_proj``).

        Args:
            experts: the module to quantize (left unchanged).
            make: builds one quantized layer from an object with a ``weight [out, in]`` and ``bias`` None (the
                config's layer quantizer, as :func:`infopt.quantize.api.quantize_` calls it).

        Returns:
            The new module, on the experts' device.

        Example:
            >>> from infopt.models import tiny_model
            >>> from infopt.quantize.formats.int8 import Int8Linear
            >>> ex = tiny_model("mixtral").model.layers[0].mlp.experts
            >>> q = QuantizedExperts.from_experts(ex, lambda m: Int8Linear.from_float(m))
            >>> q.num_experts, type(q.down_proj[0]).__name__
            (4, 'Int8Linear')
        """
        gu, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        # gu: [E, 2I, H], down: [E, H, I]
        gate_up = [make(SimpleNamespace(weight=gu[e], bias=None)) for e in range(gu.shape[0])]
        downs = [make(SimpleNamespace(weight=down[e], bias=None)) for e in range(down.shape[0])]
        return cls(gate_up, downs, experts.act_fn, hidden_dim=int(gu.shape[2]), intermediate_dim=int(down.shape[2]))

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 weights these layers stand for: ``(gate_up [E, 2I, H], down [E, H, I])``."""
        return (torch.stack([m.dequantize() for m in self.gate_up_proj]),
                torch.stack([m.dequantize() for m in self.down_proj]))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        # hidden_states: [T, H]; top_k_index, top_k_weights: [T, k]
        if torch.compiler.is_compiling():  # the loop below has data-dependent shapes: one opaque op (module doc)
            return torch.ops.infopt.quantized_experts(hidden_states, top_k_index, top_k_weights, self._handle)
        return self._dispatch(hidden_states, top_k_index, top_k_weights)

    def _dispatch(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                  ) -> torch.Tensor:
        k = top_k_index.shape[-1]
        out = torch.zeros_like(hidden_states)
        flat = top_k_index.reshape(-1)  # [T * k]
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host sync per block
        tokens = order // k
        weights = top_k_weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts[:self.num_experts]):
            if n == 0:
                continue
            idx = tokens[start:start + n]
            gate, up = self.gate_up_proj[e](hidden_states[idx]).chunk(2, dim=-1)  # [n, I] each
            y = self.down_proj[e](self.act_fn(gate) * up) * weights[start:start + n, None]  # [n, H]
            out.index_add_(0, idx, y.to(out.dtype))
            start += n
        return out

    def extra_repr(self) -> str:
        kind = type(self.gate_up_proj[0]).__name__
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, layers={kind}")


# config type -> make(experts module, config) -> QuantizedExperts
EXPERT_QUANTIZERS: dict[type, Callable[[nn.Module, object], nn.Module]] = {}


def register_experts_quantizer(config_cls: type):
    """Decorator: ``make(experts, config) -> nn.Module`` quantizes one experts module for ``config_cls``
    (:func:`infopt.quantize.api.quantize_` then includes experts for that config when its ``experts`` is True)."""

    def deco(fn):
        EXPERT_QUANTIZERS[config_cls] = fn
        return fn

    return deco


def experts_targets(model: nn.Module, config, filter_fn=None, include=None, exclude=None) -> list[str]:
    """Dotted names of the experts modules ``quantize_(model, config, ...)`` replaces, in model order (none when
    the config has no experts quantizer or ``config.experts`` is False).

    Raises:
        IncompatibleModelError: an experts module whose layout infopt cannot replace (the reason is named).
    """
    if type(config) not in EXPERT_QUANTIZERS or not getattr(config, "experts", False):
        return []
    out = []
    for b in moe_blocks(model):
        fqn = b.experts_fqn
        mod = model.get_submodule(fqn)
        if include and not any(fnmatch.fnmatchcase(fqn, p) for p in include):
            continue
        if exclude and any(fnmatch.fnmatchcase(fqn, p) for p in exclude):
            continue
        if filter_fn is not None and not filter_fn(mod, fqn):
            continue
        if getattr(mod, "infopt_expert_parallel", False):
            raise IncompatibleModelError(
                f"{type(config).__name__} cannot quantize {fqn}: its experts are split across ranks (expert "
                "parallelism). Quantize before splitting (a recipe applies quantize first), or infopt.undo(model) first"
            )
        if getattr(mod, "is_infopt_experts", False):
            continue  # already quantized
        if not b.standard:
            raise IncompatibleModelError(
                f"{type(config).__name__} cannot quantize the experts {fqn}: {b.reason}. Leave them in float with "
                f"{type(config).__name__}(experts=False) or exclude=[{fqn!r}]"
            )
        out.append(fqn)
    return out


def check_experts_shapes(model: nn.Module, config, group_size: int | None, *, out_multiple: int = 1) -> None:
    """Raise :class:`IncompatibleModelError` for experts ``config`` would quantize that its kernels cannot take:
    ``group_size`` not dividing an expert's input width (``H`` for ``gate_up``, ``I`` for ``down``), or output
    widths (``2I``, ``H``) not a multiple of ``out_multiple``."""
    wanted = set(experts_targets(model, config))
    for b in moe_blocks(model):
        if b.experts_fqn not in wanted:
            continue
        for name, width, out in (("gate_up_proj", b.hidden_size, 2 * b.intermediate_size),
                                 ("down_proj", b.intermediate_size, b.hidden_size)):
            if group_size is not None and width % group_size:
                raise IncompatibleModelError(
                    f"{type(config).__name__}(group_size={group_size}) does not divide {b.experts_fqn}.{name}'s "
                    f"input width {width}; pick a group size dividing it, or leave the experts in float with "
                    "experts=False"
                )
            if out % out_multiple:
                raise IncompatibleModelError(
                    f"{type(config).__name__}: {b.experts_fqn}.{name} has {out} output features per expert; its "
                    f"kernel needs a multiple of {out_multiple}. Leave the experts in float with experts=False"
                )
