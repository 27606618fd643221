"""``infopt::packed_linear``: fp32 and bf16 linears on oneDNN's prepacked weights, on CPUs.

The operator takes the layer's input, its weight and bias, and a *handle* under which :func:`register` keeps the
weight's packed copy (oneDNN's blocked layout for a given row count). It packs the weight again when it changed (its
version counter or storage moved), so a packed layer never computes with stale weights. Which layers route through
it, and when, is :mod:`infopt.compile.packed`'s business; inside :func:`packed_call` blocks, layers packed *scoped*
(the batching engine's) use their packed copies.
"""

from __future__ import annotations

import torch

from .scope import in_packed_call

__all__ = ["PACKED_DTYPES", "PACK_ROWS", "can_pack", "can_pack_dtype", "register",
           "forget", "is_packed", "uses_packed", "packed_linear", "kernel_calls", "count"]

PACKED_DTYPES = (torch.float32, torch.bfloat16)

PACK_ROWS = 16
"""The row count oneDNN picks the blocked layout for: the widest compiled verify (narrower calls run it as well)."""

# handle -> (weight storage pointer, weight version, packed weight, rows); entries leave with their module
_PACKED: dict[int, tuple[int, int, torch.Tensor, int]] = {}
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


def count(kernel: str) -> None:
    """Count one eager call of ``kernel`` (a key of :func:`kernel_calls`); not while compiling (dynamo would guard
    on the count)."""
    if not torch.compiler.is_compiling():
        _CALLS[kernel] += 1


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


def _pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def register(handle: int, weight: torch.Tensor, *, rows: int = PACK_ROWS, scoped: bool = False) -> None:
    """Pack ``weight`` for ``rows``-row products and keep the copy under ``handle``; ``scoped``: used only inside
    :func:`packed_call` blocks and compiled graphs (:func:`uses_packed`)."""
    _PACKED[handle] = (weight.data_ptr(), weight._version, _pack(weight, rows), rows)
    if scoped:
        _SCOPED.add(handle)


def forget(handle: int) -> None:
    """Drop ``handle``'s packed copy (its layer went, or was unpacked)."""
    _PACKED.pop(handle, None)
    _SCOPED.discard(handle)


def is_packed(handle: int | None) -> bool:
    """Whether ``handle`` holds a packed copy."""
    return handle in _PACKED


def uses_packed(handle: int) -> bool:
    """Whether the packed layer (or fused group) ``handle`` runs its packed copy now: always while compiling (a graph
    calls the operator), and in eager calls unless it was packed ``scoped`` and this is not a packed call."""
    return torch.compiler.is_compiling() or handle not in _SCOPED or in_packed_call()


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


packed_linear = torch.ops.infopt.packed_linear.default
"""``infopt::packed_linear(x, weight, bias, handle)``: ``x @ weight.T + bias`` on the copy :func:`register` keeps
for ``handle`` (packed again first if ``weight`` changed since)."""
