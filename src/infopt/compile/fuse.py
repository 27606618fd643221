"""Fused projections: one matmul for an attention layer's q/k/v and one for a gated MLP's gate/up, in place.

A decoder layer's q, k and v projections read the same input, as do its MLP's gate and up projections. Run
separately they are five matmuls per layer; fused they are two. That is fewer kernels per token on a GPU (where a
small decode step's time goes more to kernel count than to the weights it reads) and larger, better-blocked
GEMMs on a CPU (``benchmarks/fuse_projections.py``).

How it stays invisible to everything else:

- **No copy, no new parameter.** Each group's weights are moved into one buffer, back to back, and each layer's
  ``weight`` (the same ``nn.Parameter`` object) becomes a view of its rows. ``parameters()``, ``state_dict`` and
  loading see the layers as before, at the same memory; an in-place write to a layer's weight
  (``load_state_dict``, an optimizer step) writes into the fused buffer. ``state_dict()`` hands out copies of the
  fused layers' tensors (safetensors refuses views of a shared buffer), so saving costs their size once more while
  it runs.
- **The modules stay ``nn.Linear``.** Only their ``forward`` is patched: the group's first projection computes the
  fused output and returns its slice; the others return their slices of it when called on the same input tensor,
  and compute their own linear otherwise (a model that calls them on different inputs stays correct).
- **A weight that leaves the buffer is noticed.** ``model.to(...)`` and ``param.data = ...`` give a layer storage
  of its own; every eager forward checks the group's storage (a pointer comparison) and fuses the group again
  from the layers' current weights before using it; a weight written in place bumps the buffer's version, so a
  packed copy of it (:mod:`infopt.compile.packed`) is packed again. Compiled steps read the buffer as a graph
  input: a new buffer is a new input (a recompile or a new CUDA graph), never a stale one. Decoding always runs the
  prompt eagerly first, so the check runs once per ``generate`` call.

Outputs are the same sums over the same inputs; a BLAS library may block a wider GEMM differently, so results can
differ from the separate calls in the last bits (fp32 greedy output stays token-identical in the tests).
"""

from __future__ import annotations

import types
import weakref

import torch
from torch import nn

from .packed import usable as packed_usable
from .packed import wants_grad

__all__ = ["FusedGroup", "fuse_projections_", "unfuse_projections_", "GROUPS"]

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling linears that read one input, in the order a transformers decoder layer calls them."""


class FusedGroup:
    """One group of sibling linears sharing a fused weight.

    Attributes:
        layers: the ``nn.Linear`` modules, in call order.
        names: their attribute names on the parent module.
        weight: ``[sum(out_features), in_features]``, the layers' weights back to back (theirs are views of it).
        bias: the same for the biases, or None when no layer has one.
        calls: fused matmuls run (for tests and benchmarks: the first projection's forward, in eager mode).
    """

    def __init__(self, layers: list[nn.Linear], names: tuple[str, ...]):
        self.layers = [weakref.ref(m) for m in layers]
        self.names = names
        self.sizes = [m.out_features for m in layers]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(layers))]
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self._x: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._left = 0
        self.packed: int | None = None  # a handle of infopt::packed_linear once compile.packed packs this group
        self.calls = 0
        self.refuses = 0
        self._fuse()

    def modules(self) -> list[nn.Linear]:
        out = [r() for r in self.layers]
        return [m for m in out if m is not None]

    @torch.no_grad()
    def _fuse(self) -> None:
        """Move the layers' current weights (and biases) into one new buffer; their parameters become views."""
        layers = self.modules()
        weight = torch.cat([m.weight.detach() for m in layers])
        bias = None
        if any(m.bias is not None for m in layers):
            bias = torch.cat([m.bias.detach() if m.bias is not None
                              else m.weight.new_zeros(m.out_features) for m in layers])
        for m, off, n in zip(layers, self.offsets, self.sizes, strict=True):
            m.weight.data = weight[off:off + n]
            if m.bias is not None:
                m.bias.data = bias[off:off + n]
        self.weight, self.bias = weight, bias
        self._versions = self._member_versions()

    def _member_versions(self) -> tuple[int, ...]:
        # a parameter whose .data is a view keeps a version counter of its own: an in-place write through it
        # (load_state_dict, copy_) changes the fused buffer's values but not the buffer's version
        return tuple(t._version for m in self.modules() for t in (m.weight, m.bias) if t is not None)

    def intact(self) -> bool:
        """True while every layer's weight (and bias) is still its view of the fused buffer."""
        w, b = self.weight, self.bias
        for m, off in zip(self.modules(), self.offsets, strict=True):
            if m.weight.data_ptr() != w.data_ptr() + off * w.stride(0) * w.element_size():
                return False
            if m.bias is not None and (b is None or m.bias.data_ptr() != b.data_ptr() + off * b.element_size()):
                return False
        return True

    def out(self, x: torch.Tensor) -> torch.Tensor:
        """The fused output for ``x`` (computed once per input tensor; its slices are handed to the layers)."""
        if not torch.compiler.is_compiling():
            if not self.intact():
                self._fuse()
                self.refuses += 1
            elif self._member_versions() != self._versions:  # written in place: tell the buffer's readers (a
                # packed copy of it checks the buffer's version)
                from torch.autograd.graph import increment_version

                increment_version(self.weight)
                if self.bias is not None:
                    increment_version(self.bias)
                self._versions = self._member_versions()
        if self.packed is not None and packed_usable(x, self.weight):
            out = torch.ops.infopt.packed_linear(x, self.weight, self.bias, self.packed)
        else:
            out = nn.functional.linear(x, self.weight, self.bias)
        if not torch.compiler.is_compiling():
            self.calls += 1
        self._x, self._out, self._left = x, out, len(self.layers) - 1
        return out

    def take(self, x: torch.Tensor) -> torch.Tensor | None:
        """The stored fused output when ``x`` is the tensor it was computed for, else None."""
        if self._x is not x:
            return None
        out = self._out
        self._left -= 1
        if self._left <= 0:
            self._x = self._out = None
        return out

    @torch.no_grad()
    def unfuse(self) -> None:
        """Give each layer storage of its own again (the buffer is freed with the last view of it)."""
        for m in self.modules():
            m.weight.data = m.weight.data.clone()
            if m.bias is not None:
                m.bias.data = m.bias.data.clone()
        self.weight = self.bias = self._x = self._out = None


def _first_forward(group: FusedGroup, index: int):
    off, n = group.offsets[index], group.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if wants_grad(x, self.weight):
            # training: each layer its own linear (the fused buffer is no parameter, so gradients would not reach
            # the layers' weights); the members compute theirs too, finding no fused output for this input
            group._x = group._out = None
            return nn.functional.linear(x, self.weight, self.bias)
        return group.out(x).narrow(-1, off, n)

    return forward


def _member_forward(group: FusedGroup, index: int):
    off, n = group.offsets[index], group.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = group.take(x)
        if out is None:  # called on another input than the first projection was: its own linear
            return nn.functional.linear(x, self.weight, self.bias)
        return out.narrow(-1, off, n)

    return forward


def _own_storage(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict hook of a fused layer: its weight and bias as tensors of their own (safetensors, and so
    ``save_pretrained``, refuses tensors that share a storage they do not cover). Parameters asked for as such
    (``keep_vars=True``) stay the parameters."""
    for name in ("weight", "bias"):
        t = state_dict.get(prefix + name)
        if t is not None and not isinstance(t, nn.Parameter):
            state_dict[prefix + name] = t.clone()


def _eligible(parent: nn.Module, names: tuple[str, ...]) -> list[nn.Linear] | None:
    layers = [getattr(parent, n, None) for n in names]
    if not all(type(m) is nn.Linear for m in layers):  # exactly nn.Linear: quantized and wrapped layers stay
        return None
    first = layers[0]
    if any("forward" in m.__dict__ or m._forward_hooks or m._forward_pre_hooks for m in layers):
        return None  # already patched (prepacked, hooked): leave them
    same = all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
               and m.weight.device == first.weight.device and m.weight.is_contiguous() for m in layers)
    if not same or first.weight.device.type == "meta" or len({id(m) for m in layers}) != len(layers):
        return None
    if any(m.bias is not None and m.bias.dtype != first.weight.dtype for m in layers):
        return None
    return layers


def fuse_projections_(model: nn.Module) -> list[FusedGroup]:
    """Fuse every decoder layer's q/k/v projections and gated MLP's gate/up projections of ``model``, in place.

    Only groups of plain ``nn.Linear`` layers (same input size, dtype and device, forwards not already patched)
    are fused; quantized layers, GPT-2's and Phi-3's already fused projections and anything else stay as they
    are.

    Returns:
        The groups fused; :func:`unfuse_projections_` of them undoes it.

    Example:
        >>> from infopt.models import tiny_model
        >>> m = tiny_model()
        >>> ids = torch.tensor([[1, 2, 3]])
        >>> with torch.no_grad():  # inference (with a gradient wanted, each layer runs its own linear)
        ...     before = m(ids).logits
        ...     groups = fuse_projections_(m)
        ...     after = m(ids).logits
        >>> len(groups), torch.allclose(after, before, atol=1e-5), groups[0].calls
        (4, True, 1)
        >>> unfuse_projections_(groups)
    """
    groups = []
    for parent in model.modules():
        for names in GROUPS:
            layers = _eligible(parent, names)
            if layers is None:
                continue
            group = FusedGroup(layers, names)
            for i, m in enumerate(layers):
                make = _first_forward if i == 0 else _member_forward
                m.forward = types.MethodType(make(group, i), m)
                m._infopt_fused = group
                m._infopt_fused_hook = m.register_state_dict_post_hook(_own_storage)
            groups.append(group)
    return groups


def unfuse_projections_(groups: list[FusedGroup]) -> None:
    """Undo :func:`fuse_projections_`: each layer its own weight storage and forward again."""
    for group in groups:
        for m in group.modules():
            m.__dict__.pop("forward", None)
            m.__dict__.pop("_infopt_fused", None)
            hook = m.__dict__.pop("_infopt_fused_hook", None)
            if hook is not None:
                hook.remove()
        group.unfuse()
