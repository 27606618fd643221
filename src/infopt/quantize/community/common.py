"""What the community-checkpoint readers share: an empty model to fill, layer builders, bit unpacking, finishing."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...core.errors import CheckpointError
from ...core.introspect import text_config
from ..api import KERNEL_GROUP_SIZES
from ..formats.int4 import Int4Linear
from ..formats.int4_layouts import LAYOUTS as INT4_LAYOUTS
from ..formats.int4_layouts import symmetric
from ..formats.int8 import Int8Linear
from ..formats.int8_layouts import LAYOUTS as INT8_LAYOUTS
from ..serialization.export import unpack_words

__all__ = ["LoadOptions", "empty_model", "set_dense", "finish_model", "int4_layer", "int8_layer",
           "per_channel_if_uniform", "unpack_words", "read_json", "kernel_group", "check_shape", "gemma3_attention_scalar"]


class LoadOptions:
    """How layers are built: the model's float ``dtype``, whether to take the reference paths, and the activations.

    ``reference=True`` builds :class:`Int4Linear` in the ``plain`` layout (fp32 dequantize per call) and
    :class:`Int8Linear` with fp32 compute: the checkpoint's own arithmetic, for checking, slow. ``activations="int8"``
    (resolved from ``"auto"`` by :func:`infopt.quantize.formats.a8.resolve`) builds the layers that fit it in the
    ``a8`` layouts, as ``cpu-fast`` quantizes: int8 activations multiplied in integers. ``map_dense=True`` lets a
    GGUF file's large dense tensors already in ``dtype`` stay copy-on-write mappings of the file."""

    def __init__(self, dtype: torch.dtype, reference: bool = False, activations: str = "float",
                 map_dense: bool = False):
        self.dtype = dtype
        self.reference = reference
        self.activations = "float" if reference else activations
        self.map_dense = map_dense


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}); the checkpoint folder is damaged") from err


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> None:
    """Raise :class:`CheckpointError` naming ``name`` when ``t`` is not ``shape`` (and ``dtype``)."""
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)} for this layer and format")
    if dtype is not None and t.dtype != dtype:
        raise CheckpointError(f"{name}: dtype {t.dtype}, expected {dtype}")


def kernel_group(group_size: int, in_features: int) -> int:
    """The largest kernel group size that splits both ``group_size`` and ``in_features``, or ``group_size``.

    A scale shared by a group of 1024 (or by a whole row, GPTQ's ``group_size: -1``) is the same scale
    repeated over groups of 256: exact, and the int4 kernels take it.

    Example:
        >>> kernel_group(576, 576), kernel_group(1024, 4096), kernel_group(32, 64), kernel_group(16, 48)
        (64, 256, 32, 16)
    """
    for k in sorted(KERNEL_GROUP_SIZES, reverse=True):
        if k <= group_size and group_size % k == 0 and in_features % k == 0:
            return k
    return group_size


def int4_layer(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, opts: LoadOptions, *,
               bias: torch.Tensor | None = None, in_perm: torch.Tensor | None = None) -> Int4Linear:
    """An :class:`Int4Linear` from codes ``[out, in]`` (stored column order), scales/zeros ``[out, in // group_size]``,
    with the groups split to a size the kernels take (:func:`kernel_group`)."""
    k = kernel_group(group_size, codes.shape[1])
    if k != group_size:
        scales = scales.repeat_interleave(group_size // k, dim=1)
        zeros = zeros.repeat_interleave(group_size // k, dim=1)
    layout = "plain" if opts.reference else None
    if opts.activations == "int8" and INT4_LAYOUTS["a8"].fits(codes.shape[0], codes.shape[1], k) is None:
        layout = "a8_sym" if symmetric(zeros, scales) else "a8"  # symmetric codes: fp16 scales alone
    return Int4Linear.from_codes(codes, scales, zeros, group_size=k, bias=bias, in_perm=in_perm, dtype=opts.dtype,
                                 layout=layout)


def per_channel_if_uniform(scales: torch.Tensor) -> torch.Tensor:
    """Group scales ``[out, G]`` that are one value per row (a per-channel layer written in groups, as
    ``export_gguf`` writes ``cpu-fast``'s head as Q8_0) as that one scale per row ``[out]``, exactly; other scales as
    they are.

    Example:
        >>> per_channel_if_uniform(torch.tensor([[2.0, 2.0], [3.0, 3.0]])).tolist()
        [2.0, 3.0]
        >>> tuple(per_channel_if_uniform(torch.tensor([[2.0, 1.0], [3.0, 3.0]])).shape)
        (2, 2)
    """
    if scales.dim() != 2 or (scales.shape[1] > 1 and not bool((scales[:, 1] == scales[:, 0]).all())):
        return scales  # (the second column first: a file's own group scales differ there, and the check ends)
    if bool((scales == scales[:, :1]).all()):
        return scales[:, 0].contiguous()
    return scales


def int8_layer(codes: torch.Tensor, scales: torch.Tensor, opts: LoadOptions, *,
               bias: torch.Tensor | None = None) -> Int8Linear:
    """An :class:`Int8Linear` from int8 codes ``[out, in]`` and scales ``[out]`` (per channel) or ``[out, G]``.

    With ``opts.activations == "int8"`` the layer takes int8 activations where the ``a8`` layout fits it: group
    scales that are one value per row become per-channel scales (:func:`per_channel_if_uniform`); others (llama.cpp's
    Q8_0 and Q6_K blocks) stay per group, which the a8 kernel applies group by group."""
    activations = "float"
    if opts.activations == "int8":
        scales = per_channel_if_uniform(scales)
        group = None if scales.dim() == 1 else codes.shape[1] // scales.shape[1]
        if INT8_LAYOUTS["a8"].fits(codes.shape[0], codes.shape[1], group) is None:
            activations = "int8"
    return Int8Linear.from_codes(codes, scales, bias=bias, dtype=opts.dtype,
                                 compute_dtype="float32" if opts.reference else "auto", activations=activations)


def empty_model(config, dtype: torch.dtype) -> nn.Module:
    """A causal LM for ``config`` with every parameter on the meta device (no memory, no initialisation) and its
    buffers (rotary frequencies) computed on the CPU."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    try:  # transformers' initialisation walks every module even on the meta device (0.26 s at 0.5B): skipped
        from transformers.initialization import no_init_weights
    except ImportError:
        no_init_weights = nullcontext
    with init_empty_weights(include_buffers=False), no_init_weights():
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def set_dense(model: nn.Module, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Fill the parameter (or persistent buffer) ``name`` with ``tensor`` in ``dtype``, checking its shape."""
    owner_name, _, attr = name.rpartition(".")
    try:
        owner = model.get_submodule(owner_name) if owner_name else model
    except AttributeError as err:
        raise CheckpointError(f"{name}: the checkpoint has this tensor but the model has no module "
                              f"{owner_name!r}") from err
    old = owner._parameters.get(attr, owner._buffers.get(attr))
    if old is None:
        raise CheckpointError(f"{name}: the model has no parameter or buffer of this name")
    check_shape(name, tensor, tuple(old.shape))
    value = tensor.to(dtype) if tensor.is_floating_point() else tensor
    if attr in owner._parameters:
        owner._parameters[attr] = nn.Parameter(value.contiguous(), requires_grad=False)
    else:
        owner._buffers[attr] = value.contiguous()


def finish_model(model: nn.Module, *, device: str | torch.device, source: str) -> nn.Module:
    """Tie the head where the config says so, check nothing is left on the meta device, move and set eval mode.

    Raises:
        CheckpointError: a parameter the checkpoint did not provide (named).
    """
    config = model.config
    text = text_config(config)
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if getattr(text, "tie_word_embeddings", False) and head is not None and emb is not None and \
            isinstance(head, nn.Linear) and head.weight.is_meta and not emb.weight.is_meta:
        head.weight = emb.weight
    missing = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if missing:
        raise CheckpointError(f"{source}: no tensor for {', '.join(missing[:5])}"
                              f"{' ...' if len(missing) > 5 else ''}; the checkpoint is incomplete or of another "
                              "model than its config describes")
    # the quantization_config describes the source checkpoint's tensors, which this model no longer has
    if "quantization_config" in config.__dict__:
        del config.quantization_config
    model.eval()
    return model.to(device)


def gemma3_attention_scalar(layers: int, hidden: int, heads: int, head_dim: int) -> int:
    """The ``query_pre_attn_scalar`` llama.cpp's Gemma 3 graph computes with (a GGUF file has no key for it, so the
    GGUF reader sets it and the writer checks a model against it): ``head_dim``, but ``hidden / heads`` for the
    62-layer size (Gemma-3-27B: 168).

    Example:
        >>> gemma3_attention_scalar(26, 1152, 4, 256), gemma3_attention_scalar(62, 5376, 32, 128)
        (256, 168)
    """
    return hidden // heads if layers == 62 else head_dim
