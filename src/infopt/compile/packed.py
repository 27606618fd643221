"""fp32 and bf16 linears on oneDNN's prepacked weights, for the decode step and the batching engine's steps on CPUs.

On the CPUs measured here, ``F.linear`` in fp32 at the widths decoding uses (1 to 16 rows) runs well below the
memory bandwidth: MKL's kernels for a 576 x 49152 head take 7.1 ms for one row and 11 ms for eight on a 2-core AVX2
EPYC, where oneDNN's inner-product on a weight reordered once to its blocked layout takes 2.2 and 2.7 ms; a
SmolLM2 layer's seven linears go from 0.57 ms to about 0.25 ms at eight rows (``benchmarks/studies/packed_linear.py``).
Inductor's own weight prepacking (``freezing``) uses MKL's packed format on fp32, which does not help there.

:func:`pack_linears_` gives each fp32 ``nn.Linear`` of a CPU model a prepacked copy of its weight and routes its
forward through ``infopt::packed_linear``, a custom op (so a compiled graph calls it as one kernel and never traces
the opaque oneDNN tensor). The op takes the weight itself too and packs it again if it changed (its version
counter or storage moved), so a packed layer never computes with stale weights. The values are the weight's own:
the sums run in another order (like any other kernel), nothing is rounded. The cost is memory: the packed copy sits
beside the original weight, which stays for ``undo``, ``state_dict`` and tied embeddings.

A plain bf16 ``F.linear`` on CPU reorders its weight into oneDNN's blocked layout on every call, and MKL's fp32
kernels run far below the memory bandwidth at the row counts of the batching engine's steps, so the engine packs
its model too, *scoped* (``scoped=True``): those layers use the packed copy only inside its steps
(:func:`infopt.generate.packed_call`, which :meth:`infopt.generate.Forward.packed` enters) and in compiled
graphs; every other forward of the model (``generate`` outside the engine, training, a batch-invariant engine)
multiplies the plain weights as before.

:func:`infopt.ops.packed_linear.kernel_calls` counts the operator's calls (compiled graphs' included) and the packed
layers' eager calls that took ``F.linear`` instead.
"""

from __future__ import annotations

import itertools
import types
import weakref

import torch
from torch import nn

from ..ops import packed_linear as op
from ..ops.packed_linear import PACK_ROWS, PACKED_DTYPES, can_pack, can_pack_dtype, uses_packed

__all__ = ["can_pack_model", "pack_linears_", "unpack_linears_", "packed_bytes", "usable", "wants_grad", "MIN_ELEMENTS"]

MIN_ELEMENTS = 1 << 19
"""Smaller weights stay on ``F.linear``: the custom op's Python call (about 20 us) outweighs what packing saves on
a 576 x 576 or 576 x 192 layer at one row (``benchmarks/studies/packed_linear.py``)."""

_SLOTS: dict[int, int] = {}  # slot -> the token of the pack_linears_ call holding it
_SLOT = 1 << 20
_TOKENS = itertools.count()
_MODEL_SLOT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the slot it was last packed in
# A handle is the layer's index plus its model's slot times _SLOT: the same numbers each time a model is packed again,
# so its compiled graphs (which hold them as constants) hit inductor's cache after an undo; live models never share one.


def _release(slot: int, token: int) -> None:
    if _SLOTS.get(slot) == token:
        del _SLOTS[slot]


def can_pack_model(model: nn.Module) -> bool:
    """True when ``model``'s linears can run on prepacked weights: its parameters on the CPU in a dtype
    :func:`can_pack_dtype` accepts."""
    p = next(model.parameters(), None)
    return p is not None and p.device.type == "cpu" and can_pack_dtype(p.dtype)


def wants_grad(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``x @ weight.T`` must carry a gradient: grad mode on and either tensor requiring grad."""
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when a packed linear may serve ``x @ weight.T``: a CPU input of the weight's dtype, and no gradient
    wanted (the operator has no backward; where one is wanted, the plain linear runs)."""
    return (x.dtype == weight.dtype and x.device.type == "cpu" and weight.dtype in PACKED_DTYPES
            and not wants_grad(x, weight))


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    handle = self._infopt_packed
    active = uses_packed(handle)  # (False: a scoped layer outside the engine's steps, which is not counted below)
    if active and usable(x, self.weight):
        return op.packed_linear(x, self.weight, self.bias, handle)
    if active:
        op.count("linear")
    return nn.functional.linear(x, self.weight, self.bias)


def _targets(model: nn.Module, min_elements: int, dtypes=(torch.float32,)) -> list:
    """The CPU linears of ``dtypes`` to pack: plain ``nn.Linear`` layers, and the fused projection groups of
    :mod:`infopt.compile.fuse` (one packed weight per group)."""
    seen: set[int] = set()
    out = []
    for m in model.modules():
        group = m.__dict__.get("_infopt_fused")
        if group is not None:
            w = group.weight
            if (id(group) not in seen and w is not None and w.dtype in dtypes and w.device.type == "cpu"
                    and w.numel() >= min_elements and group.packed is None):
                seen.add(id(group))
                out.append(group)
        elif (type(m) is nn.Linear and id(m) not in seen and m.weight.dtype in dtypes
                and m.weight.device.type == "cpu" and "forward" not in m.__dict__
                and m.weight.numel() >= min_elements):
            seen.add(id(m))
            out.append(m)
    return out


def pack_linears_(model: nn.Module, min_elements: int = MIN_ELEMENTS,
                  dtypes: tuple[torch.dtype, ...] = (torch.float32,), *, rows: int = PACK_ROWS,
                  scoped: bool = False) -> list:
    """Route every CPU ``nn.Linear`` of ``model`` whose weight is of ``dtypes`` (exactly that class, its forward not
    already patched, with at least ``min_elements`` weights), and every such fused projection group not packed yet
    (:mod:`infopt.compile.fuse`), through ``infopt::packed_linear``, in place.

    Args:
        rows: the row count oneDNN picks the blocked layout for (any row count runs on it).
        scoped: use the packed copies only inside :func:`infopt.generate.packed_call` blocks and compiled graphs
            (the batching engine's steps); other eager calls multiply the plain weights.

    Returns:
        The layers (and fused groups) changed; :func:`unpack_linears_` of them undoes it.

    Raises:
        RuntimeError: the torch build has no oneDNN prepacked linear (:func:`can_pack` is False).

    Example:
        >>> from infopt.models import tiny_model
        >>> m = tiny_model()
        >>> layers = pack_linears_(m) if can_pack() else []
        >>> unpack_linears_(layers)
    """
    if not can_pack():
        raise RuntimeError("this torch build has no oneDNN prepacked linear (torch.ops.mkldnn._linear_pointwise); "
                           "use Compile(pack_linears=False)")
    layers = _targets(model, min_elements, dtypes)
    if not layers:
        return layers
    slot = _MODEL_SLOT.get(model)  # a model packed again (after an undo) takes its slot back: the same handles
    if slot is None or slot in _SLOTS:
        slot = next(i for i in itertools.count() if i not in _SLOTS)
    _MODEL_SLOT[model] = slot
    token = _SLOTS[slot] = next(_TOKENS)
    with torch.no_grad():
        for i, m in enumerate(layers):
            handle = slot * _SLOT + i
            op.register(handle, m.weight, rows=rows, scoped=scoped)
            if isinstance(m, nn.Module):
                m._infopt_packed = handle
                m.forward = types.MethodType(_forward, m)
            else:  # a fused projection group: its fused matmul runs on the packed copy of its fused weight
                m.packed = handle
            weakref.finalize(m, op.forget, handle)
    weakref.finalize(layers[0], _release, slot, token)
    return layers


def unpack_linears_(layers: list[nn.Linear]) -> None:
    """Undo :func:`pack_linears_` on ``layers``: their own forward again, packed copies freed."""
    for m in layers:
        if isinstance(m, nn.Module):
            handle = m.__dict__.pop("_infopt_packed", None)
            m.__dict__.pop("forward", None)
        else:  # a fused projection group
            handle, m.packed = m.packed, None
        if handle is not None:
            op.forget(handle)
            _SLOTS.pop(handle // _SLOT, None)


def packed_bytes(layers: list[nn.Linear]) -> int:
    """Bytes the packed copies of ``layers`` hold."""
    total = 0
    for m in layers:
        if op.is_packed(m.__dict__.get("_infopt_packed") if isinstance(m, nn.Module) else m.packed):
            total += m.weight.numel() * m.weight.element_size()
    return total
