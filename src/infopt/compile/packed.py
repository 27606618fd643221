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

:func:`kernel_calls` counts the operator's calls (compiled graphs' included) and the packed layers' eager calls that
took ``F.linear`` instead.
"""

from __future__ import annotations

import itertools
import types
import weakref

import torch
from torch import nn

from ..generate import in_packed_call

__all__ = ["can_pack", "can_pack_dtype", "can_pack_model", "pack_linears_", "uses_packed", "unpack_linears_", "packed_bytes", "usable", "wants_grad",
           "PACK_ROWS", "kernel_calls"]

PACKED_DTYPES = (torch.float32, torch.bfloat16)

PACK_ROWS = 16
"""The row count oneDNN picks the blocked layout for: the widest compiled verify (narrower calls run it as well)."""

MIN_ELEMENTS = 1 << 19
"""Smaller weights stay on ``F.linear``: the custom op's Python call (about 20 us) outweighs what packing saves on
a 576 x 576 or 576 x 192 layer at one row (``benchmarks/studies/packed_linear.py``)."""

# handle -> (weight storage pointer, weight version, packed weight); entries leave with their module. A handle is
# the layer's index plus its model's slot times _SLOT: the same numbers each time a model is packed again, so its
# compiled graphs (which hold them as constants) hit inductor's cache after an undo; live models never share one.
_PACKED: dict[int, tuple[int, int, torch.Tensor, int]] = {}
_SLOTS: dict[int, int] = {}  # slot -> the token of the pack_linears_ call holding it
_SLOT = 1 << 20
_TOKENS = itertools.count()
_MODEL_SLOT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the slot it was last packed in
_SCOPED: set[int] = set()  # handles used only inside packed_call() blocks and compiled graphs


_CALLS = {"packed_linear": 0, "linear": 0}  # since import (a diagnostic: unlocked, += under the GIL)


def kernel_calls() -> dict[str, int]:
    """Calls since import per kernel: ``packed_linear`` (the operator ran on a prepacked weight: every call, from a
    compiled graph too, since its kernel is Python calling oneDNN) and ``linear`` (a packed layer's eager forward that
    took ``F.linear`` instead: an input the operator does not take, or a gradient wanted). Take the difference of two
    snapshots.

    Example:
        >>> sorted(kernel_calls())
        ['linear', 'packed_linear']
    """
    return dict(_CALLS)


def _forget(handle: int) -> None:
    _PACKED.pop(handle, None)
    _SCOPED.discard(handle)


def _release(slot: int, token: int) -> None:
    if _SLOTS.get(slot) == token:
        del _SLOTS[slot]


def can_pack() -> bool:
    """True when this torch build has oneDNN's linear with prepacked weights (x86 CPU builds do)."""
    mk = getattr(torch.ops, "mkldnn", None)
    return bool(torch.backends.mkldnn.is_available() and mk is not None and hasattr(mk, "_reorder_linear_weight")
                and hasattr(mk, "_linear_pointwise"))


def can_pack_dtype(dtype: torch.dtype) -> bool:
    """True when linears of ``dtype`` can run on prepacked weights here: fp32 wherever :func:`can_pack`, bf16 where
    oneDNN also runs bf16 matmuls on this CPU (AVX512-BF16 or AMX; elsewhere it would emulate them)."""
    if dtype not in PACKED_DTYPES or not can_pack():
        return False
    if dtype == torch.float32:
        return True
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:
        return False


def can_pack_model(model: nn.Module) -> bool:
    """True when ``model``'s linears can run on prepacked weights: its parameters on the CPU in a dtype
    :func:`can_pack_dtype` accepts."""
    p = next(model.parameters(), None)
    return p is not None and p.device.type == "cpu" and can_pack_dtype(p.dtype)


def uses_packed(handle: int) -> bool:
    """Whether the packed layer (or fused group) ``handle`` runs its packed copy now: always while compiling (a graph
    calls the operator), and in eager calls unless it was packed ``scoped`` and this is not a packed call."""
    return torch.compiler.is_compiling() or handle not in _SCOPED or in_packed_call()


def _pack(weight: torch.Tensor, rows: int = PACK_ROWS) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def _packed_linear_impl(x, weight, bias, handle):
    _CALLS["packed_linear"] += 1  # runs when the operator runs, never while tracing (that is the fake below)
    entry = _PACKED.get(handle)
    key = (weight.data_ptr(), weight._version)
    if entry is None or entry[:2] != key:  # a copy's weight, or the weight was written since it was packed
        rows = entry[3] if entry is not None else PACK_ROWS
        entry = (*key, _pack(weight, rows), rows)
        _PACKED[handle] = entry
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(rows, entry[2], bias, "none", [], "")
    return out.reshape(*x.shape[:-1], weight.shape[0])


# Defined with torch.library directly rather than ``torch.library.custom_op``: the dispatcher then calls the Python
# kernel itself, about 1.5 us over the oneDNN call, where custom_op's wrapper added about 10 us to every call (121
# calls per step of the default model; ``/tmp`` scratch measurement, 64 x 64 layer). Inference only: no autograd.
_LIB = torch.library.Library("infopt", "FRAGMENT")
_LIB.define("packed_linear(Tensor x, Tensor weight, Tensor? bias, int handle) -> Tensor")
_LIB.impl("packed_linear", _packed_linear_impl, "CPU")


@torch.library.register_fake("infopt::packed_linear", lib=_LIB)
def _(x, weight, bias, handle):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


_packed_linear_op = torch.ops.infopt.packed_linear.default


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
        return _packed_linear_op(x, self.weight, self.bias, handle)
    if active and not torch.compiler.is_compiling():  # a count read while tracing would make dynamo guard on it
        _CALLS["linear"] += 1
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
            _PACKED[handle] = (m.weight.data_ptr(), m.weight._version, _pack(m.weight, rows), rows)
            if scoped:
                _SCOPED.add(handle)
            if isinstance(m, nn.Module):
                m._infopt_packed = handle
                m.forward = types.MethodType(_forward, m)
            else:  # a fused projection group: its fused matmul runs on the packed copy of its fused weight
                m.packed = handle
            weakref.finalize(m, _forget, handle)
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
            _forget(handle)
            _SLOTS.pop(handle // _SLOT, None)


def packed_bytes(layers: list[nn.Linear]) -> int:
    """Bytes the packed copies of ``layers`` hold."""
    total = 0
    for m in layers:
        entry = _PACKED.get(m.__dict__.get("_infopt_packed") if isinstance(m, nn.Module) else m.packed)
        if entry is not None:
            total += m.weight.numel() * m.weight.element_size()
    return total
