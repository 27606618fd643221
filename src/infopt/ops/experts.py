"""Operators that call a live module's method from a compiled graph: a mixture-of-experts block's expert dispatch
(``infopt::quantized_experts``, ``infopt::expert_parallel``), whose per-expert token counts are known only once the
router has run, so dynamo cannot trace it; the graph calls it as one opaque kernel that runs the eager loop.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn

__all__ = ["LiveModules", "routed_experts_op", "QUANTIZED_EXPERTS", "EXPERT_PARALLEL"]


class LiveModules:
    """Handles naming live modules to a custom op: a compiled graph holds the handle (an int constant), not the
    module (custom ops take tensors and scalars). Entries leave with their module.

    Args:
        op: the op's name, for the error when a handle's module is gone.

    Example:
        >>> live = LiveModules("infopt::example")
        >>> m = nn.Linear(2, 2)
        >>> live.get(live.register(m)) is m
        True
    """

    def __init__(self, op: str):
        self.op = op
        self._live: dict[int, weakref.ref] = {}
        self._next = itertools.count()

    def register(self, module: nn.Module) -> int:
        handle = next(self._next)
        self._live[handle] = weakref.ref(module, lambda _, h=handle: self._live.pop(h, None))
        return handle

    def get(self, handle: int) -> nn.Module:
        ref = self._live.get(handle)
        module = ref() if ref is not None else None
        if module is None:
            raise RuntimeError(f"{self.op}: the module this graph was compiled for (handle {handle}) no longer exists; "
                               "compile the model that holds it again")
        return module


def routed_experts_op(name: str, method: str) -> LiveModules:
    """Register the custom op ``name`` (``"infopt::..."``): ``(hidden_states, top_k_index, top_k_weights, handle)
    -> Tensor`` shaped like ``hidden_states``, which calls ``method`` of the live module ``handle`` names with the
    three tensors. A compiled graph calls it as one opaque kernel (its experts' dispatch never traced).

    Returns:
        The registry whose :meth:`LiveModules.register` hands out those handles.
    """
    live = LiveModules(name)

    # schema given explicitly: this file's annotations are strings (``from __future__ import annotations``)
    @torch.library.custom_op(name, mutates_args=(),
                             schema="(Tensor hidden_states, Tensor top_k_index, Tensor top_k_weights, int handle) "
                                    "-> Tensor")
    def op(hidden_states, top_k_index, top_k_weights, handle):
        return getattr(live.get(handle), method)(hidden_states, top_k_index, top_k_weights)

    @op.register_fake
    def _(hidden_states, top_k_index, top_k_weights, handle):
        return torch.empty_like(hidden_states)

    return live


QUANTIZED_EXPERTS = routed_experts_op("infopt::quantized_experts", "_dispatch")
"""Handles for ``infopt::quantized_experts``: :class:`infopt.quantize.experts.QuantizedExperts`'s dispatch."""

EXPERT_PARALLEL = routed_experts_op("infopt::expert_parallel", "_exchange")
"""Handles for ``infopt::expert_parallel``: :mod:`infopt.parallel.expert`'s exchange of routed tokens."""
