"""Graph passes the ``compile`` step adds to Inductor.

:class:`FuseSharedInputLinears` merges the int8-activation int4 linears that read one input (q/k/v of an
attention layer, gate/up of a gated MLP) into one call of ``infopt::int4_a8_linear_n``: the activations are
quantized once and all the layers' weight blocks share one parallel region, so a decode step makes two calls
per decoder layer where it made five. The model's modules stay as they are (their weights, ``state_dict``,
``undo`` and sharding are untouched); only the compiled graph changes, and each output is bit-identical to the
layer's own call.
"""

from __future__ import annotations

import hashlib
import logging
import operator
from collections import defaultdict
from pathlib import Path

import torch
from torch import fx

__all__ = ["FuseSharedInputLinears", "fuse_shared_input_linears"]

log = logging.getLogger("infopt.compile")

_VIEWS = ("view", "reshape", "_unsafe_view")


def _op(name: str):
    ns = getattr(torch.ops, "infopt", None)
    packet = getattr(ns, name, None) if ns is not None else None
    return getattr(packet, "default", None) if packet is not None else None


def _input_key(node: fx.Node):
    """What a linear reads: the node itself, or for a view/reshape its base and target shape (two views of one
    tensor to one shape are the same input)."""
    if node.op == "call_function" and getattr(node.target, "__name__", "").split(".")[0] in _VIEWS:
        return ("view", _input_key(node.args[0]) if isinstance(node.args[0], fx.Node) else node.args[0],
                tuple(node.args[1]) if isinstance(node.args[1], (list, tuple)) else node.args[1])
    return node


def fuse_shared_input_linears(graph: fx.Graph) -> int:
    """Merge every set of two or more ``infopt::int4_a8_linear`` calls on one input and group size into one
    ``infopt::int4_a8_linear_n`` call (placed at the first of them); returns the number of calls removed."""
    single, multi = _op("int4_a8_linear"), _op("int4_a8_linear_n")
    if single is None or multi is None:
        return 0
    targets = (single, torch.ops.infopt.int4_a8_linear)  # the overload (Inductor's graphs) or its packet (tracing)
    groups: dict[tuple, list[fx.Node]] = defaultdict(list)
    for n in graph.nodes:
        if n.op == "call_function" and n.target in targets and isinstance(n.args[0], fx.Node) and len(n.args) == 4:
            groups[(_input_key(n.args[0]), n.args[3])].append(n)
    order = {n: i for i, n in enumerate(graph.nodes)}
    removed = 0
    for (_, group), nodes in groups.items():
        if len(nodes) < 2:
            continue
        first = nodes[0]
        # the fused call stands where the first linear was: every weight it takes must exist by then
        if any(isinstance(a, fx.Node) and order[a] > order[first] for n in nodes for a in n.args[1:3]):
            continue
        with graph.inserting_before(first):
            fused = graph.call_function(multi, (first.args[0], [n.args[1] for n in nodes],
                                                [n.args[2] for n in nodes], group))
            if all("val" in n.meta for n in nodes):
                fused.meta["val"] = [n.meta["val"] for n in nodes]
            for i, n in enumerate(nodes):
                item = graph.call_function(operator.getitem, (fused, i))
                item.meta.update(n.meta)
                n.replace_all_uses_with(item)
        for n in nodes:
            graph.erase_node(n)
        removed += len(nodes) - 1
    if removed:
        log.debug("infopt: fused %d int8-activation linears into shared-input calls", removed)
    return removed


try:
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # torch without custom Inductor passes: the compile step adds none
    CustomGraphPass = None


if CustomGraphPass is not None:
    class FuseSharedInputLinears(CustomGraphPass):
        """:func:`fuse_shared_input_linears` as Inductor's ``post_grad_custom_post_pass``."""

        def __call__(self, graph: fx.Graph) -> None:
            fuse_shared_input_linears(graph)

        def uuid(self) -> bytes:
            # the FX graph cache keys compiled graphs on this: a change of this file recompiles
            return hashlib.sha256(Path(__file__).read_bytes()).digest()
else:  # pragma: no cover
    FuseSharedInputLinears = None
