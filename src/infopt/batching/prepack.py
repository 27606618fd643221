"""bf16 and fp32 linear weights prepacked once into oneDNN's blocked layout for the engine's steps on CPU.

A plain bf16 ``F.linear`` on CPU reorders its weight into oneDNN's blocked layout (for AMX or AVX512-BF16) on
every call; the engine calls each layer's linears once per step, so it pays that reorder hundreds of times a
second. A plain fp32 ``F.linear`` goes to MKL, whose kernels run far below the memory bandwidth at the row counts
of decode-heavy steps on the CPUs measured (see :mod:`infopt.compile.packed`). :func:`prepack_linears_` packs
each bf16 or fp32 ``nn.Linear`` weight once and routes the engine's forwards through the packed copy
(``benchmarks/engine_throughput.py`` measures the gain). Everything else the model runs (``generate`` outside the
engine, training, other wrappers) uses the plain weights as before.

The packed copies cost as much memory again as the packed weights. A weight changed in place after packing
(``load_state_dict``, an optimizer step) is detected through its version counter and its layer falls back to the
plain weight, so a stale copy is never used.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

from ..core.patch import wrap_method

__all__ = ["prepack_linears_", "packed_forwards", "supported"]

_STATE = threading.local()


def supported(model: nn.Module) -> bool:
    """True when the model's linears are fp32, or bf16 on a CPU whose oneDNN build runs bf16 matmuls, on a CPU with
    oneDNN's prepacked linear."""
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cpu":
        return False
    from ..compile.packed import can_pack_dtype

    return can_pack_dtype(p.dtype)


@contextlib.contextmanager
def packed_forwards():
    """Within this block (in this thread), prepacked linears use their packed weights."""
    before = getattr(_STATE, "on", False)
    _STATE.on = True
    try:
        yield
    finally:
        _STATE.on = before


def _make(mod: nn.Linear, packed: torch.Tensor, version: int, ptr: int):
    def wrapper(original):
        def forward(x: torch.Tensor) -> torch.Tensor:
            w = mod.weight
            # a compiled forward traces the plain linear: the packed weight is an opaque oneDNN tensor
            if (torch.compiler.is_compiling() or not getattr(_STATE, "on", False) or x.dtype != w.dtype
                    or x.device.type != "cpu" or w._version != version or w.data_ptr() != ptr):
                return original(x)
            lead = x.shape[:-1]
            out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, mod.bias, "none", [], "")
            return out.view(*lead, out.shape[-1])

        forward._infopt_prepacked = True
        return forward

    return wrapper


def prepack_linears_(model: nn.Module, *, rows_hint: int = 64, step: str | None = "batching") -> int:
    """Pack every ``nn.Linear`` weight of ``model`` in its dtype (bf16 or fp32) for :func:`packed_forwards` blocks (recorded: undo removes
    the packed copies and the forward wrappers).

    Args:
        rows_hint: the typical rows per call (oneDNN picks its blocking for it; any row count works).

    Returns:
        How many linears were packed (0 where :func:`supported` is False).
    """
    if not supported(model):
        return 0
    dtype = next(model.parameters()).dtype
    count = 0
    with torch.no_grad():
        for mod in model.modules():
            if type(mod) is not nn.Linear or mod.weight.dtype != dtype or mod.weight.device.type != "cpu":
                continue
            if getattr(mod.__dict__.get("forward"), "_infopt_prepacked", False):  # packed by an earlier engine
                continue
            w = mod.weight
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows_hint)
            wrap_method(mod, "forward", _make(mod, packed, w._version, w.data_ptr()), model=model, step=step)
            count += 1
    return count
