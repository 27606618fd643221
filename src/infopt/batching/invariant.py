"""Batch-invariant engine steps: a request's logits do not depend on which other requests share its steps.

A packed engine step multiplies every scheduled token's row by each weight in one matrix product. BLAS libraries
pick their kernel (and so the order in which a row's products are summed) by the number of rows: on this
project's CPUs, row 0 of an fp32 ``F.linear`` over 2 rows differs in the last bits from the same row alone. So a
request decoded beside 63 others, or whose prompt was split into other chunks, or which was preempted and
recomputed, can round differently from the same request alone, and a near-tie then flips a greedy token.

Inside :func:`invariant_steps` (what ``Engine(batch_invariant=True)`` wraps each step's forward in):

- every ``F.linear`` and ``torch.addmm`` (transformers' ``Conv1D``) runs as products of a fixed :data:`ROWS` rows
  each (the last one padded with zero rows, each block copied into fresh memory), so
  every row goes through the same kernel at the same shape whatever shares the call;
- the C++ paged-attention kernel sums each query row's keys in one order (:class:`infopt.attention.paged.
  fixed_key_order`: no split of long key ranges, whose count depends on the batch); its other work division
  (sequences, query chunks, KV heads) never changes a row's arithmetic;
- norms, rotary embeddings and activations are per row already.

What it costs: a decode step of one row computes :data:`ROWS` rows' products (on a CPU the weights' reading, not
the arithmetic, sets a small step's time), and a long prefill chunk calls the kernel once per :data:`ROWS` rows
instead of once (``benchmarks/batch_invariant.py`` measures the throughput).

What it covers: fp32 and bf16 float models on a CPU with the C++ paged-attention kernel, eager steps (no compiled
step, no prepacked weights: :class:`~infopt.batching.core.EngineCore` refuses those combinations). Layers holding
their weights as integer codes or fp8 (quantized layers) run their own kernels and are refused too.
"""

from __future__ import annotations

import contextlib
import itertools

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..attention.paged import fixed_key_order, load_cpu_kernel
from ..generate import Forward

__all__ = ["ROWS", "invariant_linear", "invariant_steps", "check_invariant_model", "InvariantForward"]

_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
             if hasattr(torch, n))

ROWS = 32
"""Rows per matrix product inside :func:`invariant_steps`. Measured on the default model in fp32 (32 requests of 16-256
prompt tokens, 32 new tokens; ``benchmarks/batch_invariant.py --rows N``), the mode's throughput against the eager
engine: 0.53x at 16 rows, 0.64x at 32, 0.63x at 64, 0.55x at 128."""


def _blocks(x2: torch.Tensor):
    """``x2`` ``[n, k]`` as blocks of :data:`ROWS` rows, each in fresh memory, the last padded with zero rows."""
    n = x2.shape[0]
    for i in range(0, n, ROWS):
        block = x2.new_zeros(ROWS, x2.shape[1])
        block[: min(ROWS, n - i)] = x2[i:i + ROWS]
        yield block


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with every row computed in a product of exactly :data:`ROWS` rows, so a row's
    result is the same bits whatever other rows ``x`` holds.

    Example:
        >>> w, x = torch.randn(32, 64), torch.randn(5, 64)
        >>> torch.equal(invariant_linear(x, w)[:1], invariant_linear(x[:1], w))
        True
    """
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    n = x2.shape[0]
    if n == 0:
        return F.linear(x, weight, bias)
    out = torch.cat([F.linear(b, weight, bias) for b in _blocks(x2)])[:n]
    return out.reshape(*lead, out.shape[-1])


def _invariant_addmm(bias: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    return torch.cat([torch.addmm(bias, b, w) for b in _blocks(x)])[:n]


class _FixedRows(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:  # one row too: it must take the same kernel alone as beside others
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            return invariant_linear(x, weight, args[2] if len(args) > 2 else kwargs.get("bias"))
        if func is torch.addmm and not kwargs and len(args) == 3 and args[1].dim() == 2:
            return _invariant_addmm(*args)
        return func(*args, **kwargs)


class InvariantForward(Forward):
    """The engine's eager forward with every step batch-invariant (:func:`invariant_steps`) on the plain weights
    (not the engine's prepacked copies, which oneDNN multiplies in its own blocking)."""

    def packed_scope(self):
        return invariant_steps()


@contextlib.contextmanager
def invariant_steps():
    """Run the forwards inside batch-invariantly (module docstring); the engine wraps each step in it.

    Example:
        >>> w, x = torch.randn(32, 64), torch.randn(3, 64)
        >>> with invariant_steps():
        ...     torch.equal(F.linear(x, w)[1:2], F.linear(x[1:2], w))
        True
    """
    with fixed_key_order(), _FixedRows():
        yield


def check_invariant_model(model: nn.Module) -> None:
    """Raise ValueError where :func:`invariant_steps` cannot make ``model``'s steps batch-invariant: a model off the
    CPU, the C++ paged-attention kernel missing, or layers that multiply their weights in their own kernels
    (quantized linears)."""
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"batch_invariant=True is implemented for models on a CPU (the C++ paged-attention kernel); "
                         f"this model is on {device.type}")
    if not load_cpu_kernel():
        raise ValueError("batch_invariant=True needs infopt's C++ paged-attention kernel, which could not be built "
                         "here (no C++ compiler?); see infopt.ops.cpp.build_all()")
    # a layer holding its weight as integer codes or fp8 (infopt's quantized layers, bitsandbytes') multiplies it in
    # its own kernel, not through F.linear (int64 position ids and bool masks are no weights)
    own = sorted({type(m).__name__ for m in model.modules()
                  if any((t.dim() >= 2 and not t.is_floating_point() and t.dtype not in (torch.bool, torch.int64))
                         or t.dtype in _FP8 for t in itertools.chain(m.parameters(recurse=False),
                                                                       m.buffers(recurse=False)))})
    if own:
        raise ValueError(f"batch_invariant=True covers float nn.Linear layers; this model has {', '.join(own)} layers "
                         "(a quantization step), which multiply in their own kernels. Serve the float model, or "
                         "leave batch_invariant off")
