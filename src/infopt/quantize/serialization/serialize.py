"""infopt's ``quantization_config``: which layers a saved model has quantized and how, so a loader can rebuild them.

``model.save_pretrained(dir)`` of a quantized model writes, in ``config.json``::

    "quantization_config": {
      "quant_method": "infopt", "format": 1, "infopt_version": "0.1.0",
      "configs": [{"method": "int8", ...}],              # the quantize steps applied (to_dict), informative
      "modules": {"model.layers.0.mlp.up_proj": {"kind": "int8", "in_features": 64, "out_features": 128,
                                                 "bias": false, "group_size": null, "compute_dtype": "bfloat16"},
                  "lm_head": {"kind": "int8", ..., "tied": true}, ...}}

``modules`` is read from the live model when it is saved (every :class:`Int8Linear`, :class:`Int4Linear`
and :class:`W8A8Linear`), so it always matches the weights written beside it. ``tied: true`` marks a head
tied to the input embedding that was quantized as a separate copy (the embedding keeps its weight);
``shares_embedding: true`` an int8 head whose codes the embedding reads (``share_embedding``: the embedding is
saved as the float values of those codes, and loading shares it again).
Quantized layers of other kinds (bitsandbytes, FP8) are listed with their class name as ``kind``: a loader
refuses them by name instead of building float layers that would be left randomly initialised.

The tensors each kind expects (the layers' ``state_dict``, the int4 one in its portable layout):

- ``int8``: ``weight_int8`` int8 ``[out, in]``, ``weight_scale`` fp32 ``[out]`` (``[out, in // group_size]``
  with groups), ``bias``.
- ``int4``: ``qweight`` uint8 ``[out, in // 2]``, ``scales`` and ``zeros`` fp32 ``[out, in // group_size]``,
  ``in_perm`` int64 ``[in]`` when stored (GPTQ act-order), ``bias``.
- ``w8a8``: ``weight_int8`` int8 ``[out, in]``, ``weight_scale`` fp32 ``[out]``, ``input_scale`` fp32 ``[in]``
  when stored (SmoothQuant factors that could not be folded), ``bias``.

A loader that does not know infopt (``from_pretrained`` in a process that never imported infopt, another library)
must fail rather than build float layers at random: transformers skips a ``quant_method`` it does not know with a
warning. So every quantized layer's dense key (``<fqn>.weight``) carries a :func:`placeholder`: a 1-d uint8 tensor
holding the text "infopt quantized layer: ...", whose shape no float layer accepts, and a quantized layer's own
``weight`` tensor, where it has one (bitsandbytes int8 codes, a QAT layer's float weight), is saved as
``<fqn>.weight.infopt_moved``. :func:`restore_saved_names` undoes both when infopt loads the folder.

This module needs no part of transformers; :mod:`infopt.quantize.serialization.hf` plugs it into transformers' loader.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..._version import __version__
from ...core.errors import CheckpointError
from ...core.save_hook import register_save_preparer
from ..formats.int4 import Int4Linear
from ..formats.int8 import CUDA_KERNELS as INT8_CUDA_KERNELS
from ..formats.int8 import Int8Linear, saving_compact
from ..formats.w8a8 import W8A8Linear

__all__ = ["QUANT_METHOD", "FORMAT_VERSION", "KINDS", "layer_spec", "quantization_config_for", "expected_tensors",
           "build_layer", "finish_layer", "check_spec", "check_checkpoint", "placeholder", "is_placeholder",
           "with_placeholders", "restore_saved_names", "MOVED_SUFFIX", "quantized_save"]

QUANT_METHOD = "infopt"
"""The ``quant_method`` infopt registers with transformers."""

FORMAT_VERSION = 1
"""Version of the ``modules`` layout; a loader refuses versions it does not know."""

KINDS: dict[str, type[nn.Module]] = {"int8": Int8Linear, "int4": Int4Linear, "w8a8": W8A8Linear}
"""Layer kinds a saved model can be rebuilt with, and their classes."""

_ALIGN = 64  # bytes: what torch's CPU allocator gives, and what its int8 kernels assume
_KIND_OF = {cls: kind for kind, cls in KINDS.items()}
_QUANTIZED_PACKAGES = ("infopt.quantize", "bitsandbytes")  # other quantized layers: listed, refused at load
_FIELDS = {  # kind -> the spec keys it needs besides "kind"
    "int8": ("in_features", "out_features", "bias", "group_size", "compute_dtype"),
    "int4": ("in_features", "out_features", "bias", "group_size", "in_perm", "layout", "dense"),
    "w8a8": ("in_features", "out_features", "bias", "input_scale", "kernel"),
}


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def layer_spec(module: nn.Module) -> dict[str, Any] | None:
    """The ``modules`` entry of one layer: a dict for an infopt quantized layer, ``{"kind": <class name>}`` for a
    quantized layer of another kind, None for anything else (float layers, norms)."""
    kind = _KIND_OF.get(type(module))
    if getattr(type(module), "saves_float_weight", False):
        return None  # its state dict is a float embedding's (a shared int8 embedding's head spec says so; a GGUF
        # block embedding: the rows it decodes)
    if kind is None:
        origin = type(module).__module__
        if origin.startswith(_QUANTIZED_PACKAGES) and not list(module.children()):
            return {"kind": type(module).__name__}
        return None
    spec: dict[str, Any] = {"kind": kind, "in_features": module.in_features, "out_features": module.out_features,
                            "bias": module.bias is not None}
    if kind == "int8":
        spec.update(group_size=module.group_size, compute_dtype=_dtype_name(module.compute_dtype),
                    activations=module.activations, cuda_kernel=module.cuda_kernel)
    elif kind == "int4":
        spec.update(group_size=module.group_size, in_perm=module.in_perm is not None,
                    layout="auto" if module._layout_auto else module.layout, dense=module.weight_dense is not None)
    else:
        spec.update(input_scale=module.input_scale is not None, kernel=module.kernel)
    return spec


def quantization_config_for(model: nn.Module, configs: Iterable[Any] = ()) -> dict[str, Any] | None:
    """The ``quantization_config`` dict describing ``model``'s quantized layers, or None when it has none.

    Args:
        model: a transformers model, quantized or not.
        configs: the quantize step configs applied (written with their ``to_dict``).

    Example:
        >>> from infopt.models import tiny_model
        >>> from infopt.quantize import Int8WeightOnly, quantize_
        >>> qc = quantization_config_for(quantize_(tiny_model(), Int8WeightOnly(), include=["*.mlp.*"]))
        >>> qc["quant_method"], len(qc["modules"]), qc["modules"]["model.layers.0.mlp.up_proj"]["kind"]
        ('infopt', 6, 'int8')
    """
    modules = {}
    for fqn, mod in model.named_modules():
        spec = layer_spec(mod)
        if spec is not None:
            modules[fqn] = spec
    if not modules:
        return None
    for target in getattr(model, "all_tied_weights_keys", None) or {}:
        owner = target.rpartition(".")[0]
        if owner in modules:
            modules[owner]["tied"] = True
    embed = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    head = getattr(embed, "head", None)
    for fqn, mod in model.named_modules():
        if head is not None and mod is head and fqn in modules:
            modules[fqn]["shares_embedding"] = True  # the embedding reads this head's codes (share_embedding)
    return {"quant_method": QUANT_METHOD, "format": FORMAT_VERSION, "infopt_version": __version__,
            "configs": [c.to_dict() for c in configs], "modules": modules}


def check_spec(fqn: str, spec: Any) -> None:
    """Raise :class:`CheckpointError` unless ``spec`` is a ``modules`` entry this version can rebuild."""
    kind = spec.get("kind") if isinstance(spec, dict) else None
    if kind not in KINDS:
        raise CheckpointError(
            f"{fqn}: infopt cannot rebuild a layer of kind {kind!r} with transformers' from_pretrained (it rebuilds "
            f"{', '.join(KINDS)}); load the folder with infopt.load(path), which re-applies the saved recipe"
        )
    absent = [k for k in _FIELDS[kind] if k not in spec]
    if absent:
        raise CheckpointError(f"{fqn}: the quantization_config entry for this {kind} layer lacks {', '.join(absent)}")


def expected_tensors(spec: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """``{name: (shape, dtype)}`` of the tensors a layer of ``spec`` loads; dtype None means any floating type
    (the bias, cast to the model's dtype on load).

    Example:
        >>> expected_tensors({"kind": "int8", "in_features": 64, "out_features": 32, "bias": False, "group_size": None})
        {'weight_int8': ((32, 64), torch.int8), 'weight_scale': ((32,), torch.float32)}
    """
    out_f, in_f = spec["out_features"], spec["in_features"]
    kind = spec["kind"]
    t: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {}
    if kind == "int4":
        groups = in_f // spec["group_size"]
        t["qweight"] = ((out_f, in_f // 2), torch.uint8)
        t["scales"] = ((out_f, groups), torch.float32)
        t["zeros"] = ((out_f, groups), torch.float32)
        if spec["in_perm"]:
            t["in_perm"] = ((in_f,), torch.int64)
    else:
        g = spec.get("group_size")
        t["weight_int8"] = ((out_f, in_f), torch.int8)
        t["weight_scale"] = ((out_f,) if g is None else (out_f, in_f // g), torch.float32)
        if kind == "w8a8" and spec["input_scale"]:
            t["input_scale"] = ((in_f,), torch.float32)
    if spec["bias"]:
        t["bias"] = ((out_f,), None)
    return t


def build_layer(fqn: str, spec: dict[str, Any], original: nn.Module, *, device: torch.device | str = "meta") -> nn.Module:
    """An empty layer of ``spec`` in place of ``original`` (the float layer the model was built with), whose
    ``state_dict`` names and shapes are the saved ones. An int4 layer is built in its portable layout;
    :func:`finish_layer` moves it to its kernel's layout once loaded.

    Raises:
        CheckpointError: an entry this version cannot rebuild, or shapes that do not match ``original``.
    """
    check_spec(fqn, spec)
    w = getattr(original, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise CheckpointError(f"{fqn}: the quantization_config lists a {spec['kind']} layer here, but the model has a "
                              f"{type(original).__name__} with no 2-d weight")
    shape = tuple(w.shape[::-1]) if type(original).__name__ == "Conv1D" else tuple(w.shape)  # Conv1D: [in, out]
    want = (spec["out_features"], spec["in_features"])
    if shape != want:
        raise CheckpointError(f"{fqn}: the quantization_config says {want[1]} -> {want[0]} features, the model's "
                              f"{type(original).__name__} has {shape[1]} -> {shape[0]}")
    dtype, kind = w.dtype, spec["kind"]
    out_f, in_f, bias = spec["out_features"], spec["in_features"], bool(spec["bias"])
    try:
        if kind == "int8":
            cd = spec["compute_dtype"]
            kernel = spec.get("cuda_kernel", "tl_dot")  # (saves before the field: the default)
            if kernel not in INT8_CUDA_KERNELS:
                raise ValueError(f"cuda_kernel {kernel!r} is not one of {', '.join(INT8_CUDA_KERNELS)}")
            layer = Int8Linear(in_f, out_f, bias=bias, dtype=dtype, device=device, group_size=spec["group_size"],
                               compute_dtype=None if cd is None else getattr(torch, cd))
            layer.cuda_kernel = kernel
            return layer
        if kind == "int4":
            return Int4Linear(in_f, out_f, spec["group_size"], bias=bias, dtype=dtype, device=device, layout="plain",
                              has_perm=bool(spec["in_perm"]))
        layer = W8A8Linear(in_f, out_f, bias=bias, dtype=dtype, input_scale=bool(spec["input_scale"]), device=device)
        layer.kernel = spec["kernel"]
        return layer
    except (TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{fqn}: cannot build the {kind} layer the quantization_config describes: {e}") from e


def finish_layer(spec: dict[str, Any], layer: nn.Module) -> nn.Module:
    """The layer to put in the model once ``layer`` (from :func:`build_layer`) holds the loaded tensors: int4
    layers are rebuilt in their layout (the device's kernel for ``layout: auto``) and int8-activation int8 layers
    in their block layout through ``load_state_dict``,
    the same path :func:`infopt.load` takes; a dense prompt copy is remade where the saved layer had one."""
    for p in layer.parameters():
        p.requires_grad_(False)
    # transformers may hand over tensors that view a memory-mapped file at any byte offset, and
    # torch._weight_int8pack_mm crashes (SIGSEGV, torch 2.13 CPU) on an int8 weight not 64-byte aligned
    for name, t in list(layer.named_buffers(recurse=False)):
        if t is not None and t.data_ptr() % _ALIGN:
            setattr(layer, name, t.clone())
    if spec["kind"] == "int8" and spec.get("activations", "float") == "int8":
        # loaded as [out, in] codes like any int8 layer (what transformers' loader assigns to), then moved into the
        # int8-activation kernel's block layout
        final = Int8Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, dtype=layer.out_dtype,
                           compute_dtype=layer.compute_dtype, device=layer.weight_int8.device, activations="int8",
                           group_size=layer.group_size)  # a GGUF file's Q8_0 / Q6_K scales per 32 / 16 kept
        final.load_state_dict(layer.state_dict())
        final.cuda_kernel = layer.cuda_kernel
        return final
    if spec["kind"] != "int4":
        return layer
    device = layer.qweight.device
    layout = None if spec["layout"] == "auto" else spec["layout"]
    final = Int4Linear(layer.in_features, layer.out_features, layer.group_size, bias=layer.bias is not None,
                       dtype=layer.out_dtype, device=device, layout=layout, has_perm=layer.in_perm is not None)
    final.load_state_dict(layer.state_dict())
    if spec["dense"]:
        final.enable_dense()
    return final


def _header_dtype(name: str) -> torch.dtype | None:
    return {"I8": torch.int8, "U8": torch.uint8, "I64": torch.int64, "I32": torch.int32, "F32": torch.float32,
            "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}.get(name)


def check_checkpoint(modules: dict[str, dict[str, Any]], header: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """Check that the checkpoint holds every tensor the quantized layers need, with the right shape and dtype.

    Args:
        modules: the ``modules`` entries to check.
        header: ``{key: (shape, safetensors dtype name)}`` of every tensor in the checkpoint files.

    Raises:
        CheckpointError: listing the first problems found (tensor, expected, found) and the fix.

    Example:
        >>> spec = {"kind": "int8", "in_features": 64, "out_features": 32, "bias": False, "group_size": None}
        >>> check_checkpoint({"fc": spec}, {"fc.weight_int8": ((32, 64), "I8"), "fc.weight_scale": ((32,), "F32")})
        >>> try:
        ...     check_checkpoint({"fc": spec}, {"fc.weight_int8": ((32, 64), "I8")})
        ... except CheckpointError as e:
        ...     print("fc.weight_scale is missing" in str(e))
        True
    """
    problems = []
    for fqn, spec in modules.items():
        for name, (shape, dtype) in expected_tensors(spec).items():
            key = f"{fqn}.{name}"
            if key not in header:
                problems.append(f"{key} is missing")
                continue
            got_shape, got_dtype = header[key]
            got = _header_dtype(got_dtype)
            if tuple(got_shape) != shape:
                problems.append(f"{key} has shape {list(got_shape)}, expected {list(shape)}")
            elif (got != dtype) if dtype is not None else (got is None or not got.is_floating_point):
                problems.append(f"{key} is {got_dtype}, expected {_dtype_name(dtype) or 'a float type'}")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(
            f"the checkpoint does not hold the quantized layers its quantization_config describes: "
            f"{'; '.join(problems[:5])}{more}. The files were changed or truncated after saving; save the model again"
        )


_PLACEHOLDER = (b"infopt quantized layer: import infopt before from_pretrained, or load the folder with "
                b"infopt.load(path)")
MOVED_SUFFIX = ".infopt_moved"
"""Appended to a quantized layer's own ``weight`` key in a ``save_pretrained`` folder (its place holds a
:func:`placeholder`)."""


def placeholder() -> torch.Tensor:
    """The tensor saved at a quantized layer's dense key: uint8 ``[n]`` bytes of a message saying how to load the
    folder; a float layer's 2-d ``weight`` never fits it, so a loader that does not know infopt refuses the folder."""
    return torch.tensor(list(_PLACEHOLDER), dtype=torch.uint8)


def is_placeholder(t: object) -> bool:
    """True for a tensor :func:`placeholder` made (compared by content)."""
    return (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 and t.numel() == len(_PLACEHOLDER)
            and bytes(t.tolist()) == _PLACEHOLDER)


def with_placeholders(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a state dict of ``model``) as ``save_pretrained`` writes it: each quantized layer's ``weight`` (if
    it has one) moved to ``<fqn>.weight.infopt_moved`` and a :func:`placeholder` at ``<fqn>.weight``. A new dict;
    the tensors are ``state``'s own.

    Example:
        >>> from infopt.models import tiny_model
        >>> from infopt.quantize import Int8WeightOnly, quantize_
        >>> m = quantize_(tiny_model(), Int8WeightOnly(), include=["model.layers.0.mlp.up_proj"])
        >>> out = with_placeholders(m, m.state_dict())
        >>> is_placeholder(out["model.layers.0.mlp.up_proj.weight"]), is_placeholder(out["lm_head.weight"])
        (True, False)
    """
    out = dict(state)
    for fqn, mod in model.named_modules():
        if layer_spec(mod) is None:
            continue
        key = f"{fqn}.weight" if fqn else "weight"
        if key in out:
            out[key + MOVED_SUFFIX] = out.pop(key)
        out[key] = placeholder()
    return out


def restore_saved_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Undo :func:`with_placeholders` on tensors read from a folder: placeholders dropped, moved weights back at
    their keys. A state dict without either is returned as it is."""
    out = {k: v for k, v in state.items() if not is_placeholder(v)}
    for key in [k for k in out if k.endswith(MOVED_SUFFIX)]:
        out[key[: -len(MOVED_SUFFIX)]] = out.pop(key)
    return out


_UNSET = object()


@register_save_preparer
@contextlib.contextmanager
def quantized_save(model: nn.Module, configs: list, kwargs: dict[str, Any]):
    """Around ``save_pretrained`` of a model with infopt's save hook (:func:`infopt.core.save_hook.install_save_hook`):
    refuse what transformers' layout cannot hold, and while transformers writes, give the config the
    ``quantization_config`` of :func:`quantization_config_for` and the state dict a :func:`placeholder` for each
    quantized layer's float weight.

    Args:
        model: the model being saved.
        configs: the quantize step configs applied whose layers are still in place.
        kwargs: ``save_pretrained``'s keyword arguments; ``state_dict`` is set here when the model has quantized
            layers.

    Raises:
        CheckpointError: the model is sharded by expert parallelism, or has quantized mixture-of-experts experts.

    Example:
        >>> from infopt.models import tiny_model
        >>> from infopt.quantize import Int8WeightOnly, quantize_
        >>> model, kwargs = quantize_(tiny_model(), Int8WeightOnly()), {}
        >>> with quantized_save(model, [], kwargs):
        ...     model.config.quantization_config["quant_method"], is_placeholder(kwargs["state_dict"][
        ...         "model.layers.0.mlp.up_proj.weight"])
        ('infopt', True)
        >>> hasattr(model.config, "quantization_config")
        False
    """
    if any(getattr(m, "infopt_expert_parallel", False) for m in model.modules()):
        raise CheckpointError(
            "save_pretrained cannot write an expert-parallel model: this rank holds only its slice of the "
            "experts. Save before sharding, or infopt.undo(model) first"
        )
    if any(getattr(m, "is_infopt_experts", False) for m in model.modules()):
        # transformers rewrites MoE expert tensors into its checkpoint layout as it saves (3D -> per expert),
        # which per-expert quantized layers do not have; refuse rather than write a folder that cannot load
        raise CheckpointError(
            "save_pretrained cannot write quantized mixture-of-experts experts (transformers converts expert "
            "weights to its checkpoint layout when saving); use infopt.save_optimized(model, dir) and "
            "infopt.load_optimized(dir), or quantize with experts=False"
        )
    qc = quantization_config_for(model, configs)
    config = model.config
    previous = config.__dict__.get("quantization_config", _UNSET)
    if qc is not None:
        config.quantization_config = qc
        # each quantized layer's dense key gets a tensor no float layer fits: a loader that does not know
        # infopt refuses the folder instead of initialising those layers at random
        state = kwargs.get("state_dict")
        if state is None:
            with saving_compact():  # a shared embedding is rebuilt from its head's codes at load
                state = model.state_dict()
        kwargs["state_dict"] = with_placeholders(model, state)
    try:
        yield
    finally:
        if qc is not None:
            if previous is _UNSET:
                del config.quantization_config
            else:
                config.quantization_config = previous
