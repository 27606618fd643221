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

Quantized layers fuse the same way where one layer of their class can compute the group (:class:`QuantizedFusedGroup`:
per-channel ``Int8Linear`` with float activations, ``Int4Linear`` in the ``gemv`` layout, ``FP8Linear`` with
per-row scales, weight-only or not): their code and scale buffers move into shared buffers, and a hidden layer of the
class over those buffers runs whichever kernel the class picks for the call. Int4 layers in the CPU and tinygemm kernels' packed layouts (whose rows do not concatenate) and
int8-activation layers (fused by :mod:`infopt.compile.passes` in the compiled graph) stay as they are.

Outputs are the same sums over the same inputs; a BLAS library may block a wider GEMM differently, so results can
differ from the separate calls in the last bits (fp32 greedy output stays token-identical in the tests).
"""

from __future__ import annotations

import types
import weakref

import torch
from torch import nn
from torch.autograd.graph import increment_version

from ..ops.packed_linear import packed_linear, uses_packed
from ..quantize.formats.fp8 import FP8Linear
from ..quantize.formats.int4 import Int4Linear
from ..quantize.formats.int4_layouts import LAYOUTS
from ..quantize.formats.int8 import Int8Linear
from ..quantize.formats.int8_layouts import LAYOUTS as INT8_LAYOUTS
from .packed import usable as packed_usable
from .packed import wants_grad

__all__ = ["FusedGroup", "QuantizedFusedGroup", "fuse_projections_", "unfuse_projections_", "GROUPS"]

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling linears that read one input, in the order a transformers decoder layer calls them."""


class FusedGroup:
    """One group of sibling linears sharing fused tensors.

    Attributes:
        layers: the ``nn.Linear`` modules, in call order.
        names: their attribute names on the parent module.
        tensors: the names of the per-layer tensors fused (``("weight",)`` for float linears).
        fused: ``{name: [sum(out_features), ...]}``, the layers' tensors back to back (theirs are views of them).
        weight: the fused weight (float groups; None for a :class:`QuantizedFusedGroup`).
        bias: the same for the biases, or None when no layer has one.
        calls: fused matmuls run (for tests and benchmarks: the first projection's forward, in eager mode).
    """

    def __init__(self, layers: list[nn.Linear], names: tuple[str, ...], tensors: tuple[str, ...] = ("weight",)):
        self.layers = [weakref.ref(m) for m in layers]
        self.names = names
        self.tensors = tensors
        self.sizes = [m.out_features for m in layers]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(layers))]
        self.fused: dict[str, torch.Tensor] = {}
        self.bias: torch.Tensor | None = None
        self._x: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._left = 0
        self.packed: int | None = None  # a handle of infopt::packed_linear once compile.packed packs this group
        self.calls = 0
        self.refuses = 0
        self._fuse()

    @property
    def weight(self) -> torch.Tensor | None:
        return self.fused.get("weight")

    def modules(self) -> list[nn.Linear]:
        out = [r() for r in self.layers]
        return [m for m in out if m is not None]

    @staticmethod
    def _set(m: nn.Module, name: str, t: torch.Tensor) -> None:
        # a parameter keeps its identity (optimizers, hooks and the module's own references see the same object)
        old = getattr(m, name)
        if isinstance(old, nn.Parameter):
            old.data = t
        else:
            setattr(m, name, t)

    @torch.no_grad()
    def _fuse(self) -> None:
        """Move the layers' current tensors (and biases) into new buffers; theirs become views."""
        layers = self.modules()
        self.fused = {n: torch.cat([getattr(m, n).detach() for m in layers]) for n in self.tensors}
        bias = None
        if any(m.bias is not None for m in layers):
            ref = next(m.bias for m in layers if m.bias is not None)
            bias = torch.cat([m.bias.detach() if m.bias is not None else ref.new_zeros(m.out_features)
                              for m in layers])
        for m, off, n in zip(layers, self.offsets, self.sizes, strict=True):
            for name, t in self.fused.items():
                self._set(m, name, t[off:off + n])
            if m.bias is not None:
                m.bias.data = bias[off:off + n]
        self.bias = bias
        self._fused_now(layers)
        self._versions = self._member_versions()

    def _fused_now(self, layers: list[nn.Module]) -> None:
        """Called once the layers' tensors are views of the fused ones (a subclass builds what computes them)."""

    def _member_versions(self) -> tuple[int, ...]:
        # a tensor that is a view keeps a version counter of its own: an in-place write through it (load_state_dict,
        # copy_) changes the fused buffer's values but not the buffer's version
        return tuple(t._version for m in self.modules() for t in (*(getattr(m, n) for n in self.tensors), m.bias)
                     if t is not None)

    def intact(self) -> bool:
        """True while every layer's tensors (and bias) are still their views of the fused buffers."""
        b = self.bias
        for m, off in zip(self.modules(), self.offsets, strict=True):
            for name, f in self.fused.items():
                if getattr(m, name).data_ptr() != f.data_ptr() + off * f.stride(0) * f.element_size():
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
                for t in self._fused_tensors():
                    increment_version(t)
                self._versions = self._member_versions()
        out = self._compute(x)
        if not torch.compiler.is_compiling():
            self.calls += 1
        self._x, self._out, self._left = x, out, len(self.layers) - 1
        return out

    def _fused_tensors(self) -> list[torch.Tensor]:
        return [*self.fused.values(), *([self.bias] if self.bias is not None else [])]

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and packed_usable(x, self.weight) and uses_packed(self.packed):
            return packed_linear(x, self.weight, self.bias, self.packed)
        return nn.functional.linear(x, self.weight, self.bias)

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
        """Give each layer storage of its own again (the buffers are freed with the last views of them)."""
        for m in self.modules():
            for name in self.tensors:
                self._set(m, name, getattr(m, name).detach().clone())
            if m.bias is not None:
                m.bias.data = m.bias.data.clone()
        self.fused = {}
        self.bias = self._x = self._out = None


class QuantizedFusedGroup(FusedGroup):
    """One group of sibling quantized layers of one class (per-channel ``Int8Linear`` with float activations,
    ``Int4Linear`` in the ``gemv`` layout, per-row ``FP8Linear``): each of their code and scale buffers moves into one
    buffer, back to back (theirs become views), and one hidden layer of the same class over those buffers computes the group's output, so
    every kernel path of that class serves the fused call. ``weight`` is None (nothing here is packed)."""

    def __init__(self, layers: list[nn.Module], names: tuple[str, ...], tensors: tuple[str, ...]):
        self.layer: nn.Module | None = None
        super().__init__(layers, names, tensors)

    def _fused_now(self, layers: list[nn.Module]) -> None:
        for m in layers:
            getattr(m, "_scale_cache", {}).clear()
        self.layer = _like(layers[0], sum(self.sizes), self.fused, self.bias)

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    @torch.no_grad()
    def unfuse(self) -> None:
        super().unfuse()
        for m in self.modules():
            getattr(m, "_scale_cache", {}).clear()
        self.layer = None


def _quantized_tensors(m: nn.Module) -> tuple[str, ...] | None:
    """The code and scale buffers of a quantized layer that :class:`QuantizedFusedGroup` fuses, or None for a layer
    it does not take."""
    if type(m) is Int8Linear and m.group_size is None:  # per channel: _like builds no group scales
        layout = INT8_LAYOUTS[m.layout]  # the layout says whether its codes concatenate along the rows
        return (*layout.buffers, "weight_scale") if layout.concatenates else None
    if type(m) is Int4Linear and m.in_perm is None and m.weight_dense is None:
        layout = LAYOUTS[m.layout]  # the layout says whether its buffers concatenate along the rows
        return layout.buffers if layout.concatenates else None
    if type(m) is FP8Linear and m.granularity == "row":  # one scale per output row: rows concatenate
        return ("weight_fp8", "weight_scale")
    return None


def _like(first: nn.Module, out_features: int, tensors: dict[str, torch.Tensor], bias: torch.Tensor | None
          ) -> nn.Module:
    """A layer of ``first``'s class and settings with ``out_features`` outputs whose buffers are ``tensors``."""
    if isinstance(first, Int8Linear):
        new = Int8Linear(first.in_features, out_features, bias=bias is not None, dtype=first.out_dtype,
                         compute_dtype=first.compute_dtype, device="meta")
        new.cuda_kernel = first.cuda_kernel
    elif isinstance(first, FP8Linear):
        new = FP8Linear(first.in_features, out_features, bias=bias is not None,
                        dtype=bias.dtype if bias is not None else torch.float32, granularity=first.granularity,
                        activations=first.activations, device="meta")
        new.kernel = first.kernel
    else:
        new = Int4Linear(first.in_features, out_features, first.group_size, bias=bias is not None,
                         dtype=first.out_dtype, device="meta", layout=first.layout)
    for name, t in tensors.items():
        setattr(new, name, t)
    if bias is not None:
        new.bias = nn.Parameter(bias, requires_grad=False)
    return new


def _first_forward(group: FusedGroup, index: int):
    off, n = group.offsets[index], group.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self, nn.Linear) and wants_grad(x, self.weight):
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
        if out is None:  # called on another input than the first projection was: its own layer's forward
            return type(self).forward(self, x)
        return out.narrow(-1, off, n)

    return forward


def _own_storage(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict hook of a fused layer: its weight and bias as tensors of their own (safetensors, and so
    ``save_pretrained``, refuses tensors that share a storage they do not cover). Parameters asked for as such
    (``keep_vars=True``) stay the parameters."""
    for key, t in list(state_dict.items()):
        if (key.startswith(prefix) and "." not in key[len(prefix):] and isinstance(t, torch.Tensor)
                and not isinstance(t, nn.Parameter)):
            state_dict[key] = t.clone()


def _eligible_quantized(layers: list) -> tuple[str, ...] | None:
    """The buffers to fuse when ``layers`` are quantized layers of one class that :class:`QuantizedFusedGroup`
    takes, with the same settings, device and input size; else None."""
    tensors = _quantized_tensors(layers[0]) if layers[0] is not None else None
    if tensors is None or any(type(m) is not type(layers[0]) or _quantized_tensors(m) != tensors for m in layers):
        return None
    first = layers[0]
    keys = ("in_features", "out_dtype", "compute_dtype", "cuda_kernel", "group_size", "layout", "granularity",
            "activations", "kernel")
    if any(getattr(m, k, None) != getattr(first, k, None) for m in layers for k in keys):
        return None
    device = getattr(first, tensors[0]).device
    if device.type == "meta" or any(getattr(m, n).device != device or not getattr(m, n).is_contiguous()
                                    for m in layers for n in tensors):
        return None
    if any("forward" in m.__dict__ or m._forward_hooks or m._forward_pre_hooks for m in layers):
        return None
    return tensors if len({id(m) for m in layers}) == len(layers) else None


def _eligible(parent: nn.Module, names: tuple[str, ...]) -> list[nn.Linear] | None:
    layers = [getattr(parent, n, None) for n in names]
    if not all(type(m) is nn.Linear for m in layers):  # exactly nn.Linear (quantized layers: _eligible_quantized)
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

    Groups of plain ``nn.Linear`` layers (same input size, dtype and device, forwards not already patched) are
    fused, and groups of quantized layers one layer of their class can compute (:class:`QuantizedFusedGroup`);
    other quantized layers, GPT-2's and Phi-3's already fused projections and anything else stay as they are.

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
            quantized = None
            if layers is None:
                layers = [getattr(parent, n, None) for n in names]
                quantized = _eligible_quantized(layers)
                if quantized is None:
                    continue
            group = FusedGroup(layers, names) if quantized is None else QuantizedFusedGroup(layers, names, quantized)
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
