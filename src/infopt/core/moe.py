"""Mixture-of-experts introspection: each decoder layer's sparse block, router, experts and shared expert.

Found by structure, not by family name: an *experts module* is one holding 3D expert weights
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` (the layout of transformers v5's Mixtral, Qwen2/Qwen3-MoE,
OLMoE and the families built like them); its parent is the sparse block; the block's *router* is the child with a
``[E, H]`` weight; a *shared expert* is a child MLP every token goes through (Qwen2-MoE), optionally scaled by a
``[1, H]`` sigmoid gate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from .errors import IncompatibleModelError
from .introspect import text_config

__all__ = ["MoEBlock", "moe_blocks", "is_moe", "is_experts_module", "require_dense", "moe_param_counts"]


@dataclass(frozen=True)
class MoEBlock:
    """One sparse MoE block.

    Attributes:
        layer: index of the decoder layer holding it (-1 when it sits outside ``model.layers``).
        block_fqn: the block (its ``forward`` routes and combines).
        router_fqn: the module scoring experts (``weight [E, H]``), or None if none was recognised.
        experts_fqn: the experts module (3D ``gate_up_proj`` and ``down_proj``).
        shared_fqns: shared-expert MLPs every token goes through (Qwen2-MoE's ``shared_expert``).
        shared_gate_fqn: the ``[1, H]`` linear gating the shared expert, or None.
        num_experts, top_k: experts in the block, experts each token uses.
        hidden_size, intermediate_size: ``H`` and one expert's ``I``.
        standard: the experts follow transformers' default contract (``forward(x, top_k_index, top_k_weights)``,
            ``[gate; up]`` concatenated, not transposed, no bias, ``act(gate) * up``), so infopt can replace them.
        reason: why ``standard`` is False ("" when it is True).
    """

    layer: int
    block_fqn: str
    router_fqn: str | None
    experts_fqn: str
    shared_fqns: tuple[str, ...]
    shared_gate_fqn: str | None
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    standard: bool
    reason: str = ""


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` holds experts as 3D weights: ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``
    parameters (or an infopt replacement of such a module, which says so with ``is_infopt_experts``).

    Example:
        >>> from infopt.models import tiny_model
        >>> is_experts_module(tiny_model("mixtral").model.layers[0].mlp.experts)
        True
    """
    if getattr(module, "is_infopt_experts", False):
        return True
    gu = module._parameters.get("gate_up_proj")
    down = module._parameters.get("down_proj")
    return (gu is not None and down is not None and gu.dim() == 3 and down.dim() == 3
            and gu.shape[0] == down.shape[0])


def _nonstandard_reason(experts: nn.Module) -> str:
    if getattr(experts, "is_infopt_experts", False):
        return ""
    gu, down = experts.gate_up_proj, experts.down_proj
    flags = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
             "has_post_expert_norm": False}
    for name, want in flags.items():
        if getattr(experts, name, want) != want:
            return f"{name}={getattr(experts, name)!r} (infopt handles {name}={want!r})"
    if gu.shape[1] != 2 * down.shape[2] or gu.shape[2] != down.shape[1]:
        return (f"gate_up_proj {tuple(gu.shape)} and down_proj {tuple(down.shape)} are not [E, 2I, H] and [E, H, I] "
                "(transposed or biased experts)")
    gate = getattr(type(experts), "_apply_gate", None)
    if gate is not None:
        try:
            from transformers.integrations.moe import _default_apply_gate
        except ImportError:  # pragma: no cover - transformers without the experts interface
            _default_apply_gate = gate
        if gate is not _default_apply_gate:
            return f"{type(experts).__name__} overrides the gating (_apply_gate)"
    if not callable(getattr(experts, "act_fn", None)):
        return f"{type(experts).__name__} has no act_fn"
    return ""


def _layer_index(fqn: str, layer_prefixes: tuple[str, ...]) -> int:
    for prefix in layer_prefixes:
        m = re.match(re.escape(prefix) + r"\.(\d+)\.", fqn + ".")
        if m:
            return int(m.group(1))
    return -1


def moe_blocks(model: nn.Module) -> tuple[MoEBlock, ...]:
    """Every sparse MoE block of ``model``, in model order (empty for a dense model).

    Args:
        model: any ``nn.Module``; transformers causal LMs of any family (found by structure).

    Returns:
        A tuple of :class:`MoEBlock`.

    Raises:
        Nothing: a block whose experts infopt cannot replace is returned with ``standard=False`` and a ``reason``.

    Example:
        >>> from infopt.models import tiny_model
        >>> b = moe_blocks(tiny_model("qwen2_moe"))[0]
        >>> b.experts_fqn, b.router_fqn, b.shared_fqns, b.num_experts, b.top_k
        ('model.layers.0.mlp.experts', 'model.layers.0.mlp.gate', ('model.layers.0.mlp.shared_expert',), 4, 2)
    """
    tc = text_config(getattr(model, "config", None))
    layer_prefixes = tuple(n for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and n.endswith("layers"))
    out = []
    found: list[str] = []
    for fqn, experts in model.named_modules():
        if not is_experts_module(experts) or "." not in fqn:
            continue
        if any(fqn.startswith(f + ".") for f in found):
            continue  # experts held inside an infopt experts module (expert parallelism's local slice) are part of it
        found.append(fqn)
        block_fqn = fqn.rsplit(".", 1)[0]
        block = model.get_submodule(block_fqn)
        if getattr(experts, "is_infopt_experts", False):
            e, inter, hidden = experts.num_experts, experts.intermediate_dim, experts.hidden_dim
        else:
            e, two_i, hidden = experts.gate_up_proj.shape
            inter = int(experts.down_proj.shape[2])
        router = shared_gate = None
        shared = []
        for name, child in block.named_children():
            if child is experts:
                continue
            w = getattr(child, "weight", None)
            if isinstance(w, torch.Tensor) and w.dim() == 2 and tuple(w.shape) == (e, hidden) and router is None:
                router = f"{block_fqn}.{name}"
            elif isinstance(w, torch.Tensor) and w.dim() == 2 and tuple(w.shape) == (1, hidden):
                shared_gate = f"{block_fqn}.{name}"
            elif any(isinstance(m, nn.Linear) for m in child.modules()):
                shared.append(f"{block_fqn}.{name}")
        top_k = None
        for src in (model.get_submodule(router) if router else None, block, tc):
            for attr in ("top_k", "num_experts_per_tok"):
                v = getattr(src, attr, None) if src is not None else None
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    top_k = v
                    break
            if top_k is not None:
                break
        reason = _nonstandard_reason(experts)
        if not reason and router is None:
            reason = f"no router (a child of {block_fqn} with a [{e}, {hidden}] weight) was found"
        out.append(MoEBlock(layer=_layer_index(fqn, layer_prefixes), block_fqn=block_fqn, router_fqn=router,
                            experts_fqn=fqn, shared_fqns=tuple(shared), shared_gate_fqn=shared_gate,
                            num_experts=int(e), top_k=int(top_k or 1), hidden_size=int(hidden),
                            intermediate_size=int(inter), standard=not reason, reason=reason))
    return tuple(out)


def is_moe(model: nn.Module) -> bool:
    """Whether ``model`` has at least one mixture-of-experts block (see :func:`moe_blocks`).

    Example:
        >>> from infopt.models import tiny_model
        >>> is_moe(tiny_model("mixtral")), is_moe(tiny_model("llama"))
        (True, False)
    """
    return any(is_experts_module(m) for m in model.modules())


def require_dense(model: nn.Module, step: str, reason: str, *, instead: str = "") -> None:
    """Raise :class:`IncompatibleModelError` when ``model`` is a mixture-of-experts model that ``step`` cannot handle.

    Args:
        model: the model the step would patch.
        step: the step's name, as the message shows it (``"tensor_parallel_"``).
        reason: why the step cannot handle expert blocks.
        instead: what to use instead, if anything.

    Raises:
        IncompatibleModelError: the model has MoE blocks.

    Example:
        >>> from infopt.models import tiny_model
        >>> require_dense(tiny_model("llama"), "my_step", "it assumes one MLP per layer")  # a dense model passes
    """
    blocks = moe_blocks(model)
    if blocks:
        raise IncompatibleModelError(
            f"{step} does not support mixture-of-experts models ({blocks[0].experts_fqn} holds "
            f"{blocks[0].num_experts} experts): {reason}" + (f". Use {instead} instead" if instead else "")
        )


def moe_param_counts(model: nn.Module) -> dict[str, int]:
    """Parameter counts of a built model: resident (all) against active per token (non-expert parameters, plus
    ``top_k / num_experts`` of each block's routed experts; shared experts always count).

    Counts are of the float parameters as built (tied weights once); quantized experts count their logical
    ``E * (2I * H + H * I)`` weights.

    Returns:
        ``{"total", "experts", "active_experts", "non_expert", "active"}``.

    Example:
        >>> from infopt.models import tiny_model
        >>> c = moe_param_counts(tiny_model("mixtral"))
        >>> c["active"] < c["total"], c["total"] == c["experts"] + c["non_expert"]
        (True, True)
    """
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    experts = active = 0
    expert_param_ids: set[int] = set()
    for b in moe_blocks(model):
        mod = model.get_submodule(b.experts_fqn)
        n = b.num_experts * 3 * b.intermediate_size * b.hidden_size
        experts += n
        active += n * b.top_k // b.num_experts
        expert_param_ids |= {id(p) for p in mod.parameters()}
    # quantized experts hold buffers, not parameters: their logical weights are added to the total here
    in_params = sum(p.numel() for p in model.parameters() if id(p) in expert_param_ids)
    total = total - in_params + experts
    non_expert = total - experts
    return {"total": total, "experts": experts, "active_experts": active, "non_expert": non_expert,
            "active": non_expert + active}
