"""``load_quantized``: community GPTQ / AWQ folders and GGUF files straight onto infopt's int4/int8 layers."""

from __future__ import annotations

import ctypes
import logging
import os
import time
from pathlib import Path

import torch
from torch import nn
from transformers import GenerationConfig

from ...core.errors import CheckpointError
from ...core.save_hook import install_save_hook
from ...models import register_quantized_loader
from ..formats import a8
from .common import LoadOptions, empty_model, finish_model, set_dense
from .gptq_ckpt import AWQFormat, GPTQFormat, SafetensorsFolder, awq_layer, gptq_layer, read_quant_config

__all__ = ["load_quantized", "detect_format", "FORMATS"]

log = logging.getLogger(__name__)

FORMATS = ("gptq", "awq", "gguf")
"""Checkpoint formats :func:`load_quantized` reads."""


def detect_format(path: str | os.PathLike) -> str:
    """``"gguf"`` for a ``.gguf`` file (or a folder holding exactly one), else the ``quant_method`` of the folder's
    quantization config (``"gptq"`` or ``"awq"``).

    Raises:
        FileNotFoundError: no such file or folder.
        CheckpointError: a folder with no quantization config, or one of another method.

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "m.gguf"; _ = p.write_bytes(b"GGUF")
        >>> detect_format(p)
        'gguf'
    """
    p = Path(path)
    if p.is_file():
        if p.suffix.lower() == ".gguf" or p.read_bytes()[:4] == b"GGUF":
            return "gguf"
        raise CheckpointError(f"{p}: a file that is not GGUF; pass a GGUF file or a GPTQ/AWQ checkpoint folder")
    if not p.is_dir():
        raise FileNotFoundError(f"{p}: no such file or folder (infopt loads local checkpoints only)")
    q = read_quant_config(p)
    if q is None:
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf"
        hint = f" (it holds {len(ggufs)} GGUF files: pass one)" if ggufs else ""
        raise CheckpointError(f"{p}: no quantization_config in config.json, no quantize_config.json or "
                              f"quant_config.json{hint}; infopt.load_quantized reads GPTQ and AWQ folders and GGUF "
                              "files. A plain folder loads with infopt.models.load_model")
    method = str(q.get("quant_method", "")).lower()
    if method not in ("gptq", "awq"):
        raise CheckpointError(f"{p}: quant_method {method!r}; load_quantized reads gptq, awq (folders) and GGUF "
                              "files. An infopt-saved model loads with plain from_pretrained after import infopt")
    return method


def _load_folder(folder: Path, method: str, opts: LoadOptions, *, with_tokenizer: bool):
    from transformers import AutoConfig

    q = read_quant_config(folder)
    fmt = (GPTQFormat if method == "gptq" else AWQFormat).from_dict(q, str(folder))
    build = gptq_layer if method == "gptq" else awq_layer
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder}: no config.json; the model's architecture is unknown")
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    model = empty_model(config, opts.dtype)
    tensors = SafetensorsFolder(folder)
    prefixes = tensors.quantized_prefixes()
    if not prefixes:
        raise CheckpointError(f"{folder}: quant_method {method} but no '*.qweight' tensor in its safetensors")
    for prefix in prefixes:
        try:
            linear = model.get_submodule(prefix)
        except AttributeError as err:
            raise CheckpointError(f"{prefix}.qweight: the model has no module {prefix!r}") from err
        if not isinstance(linear, nn.Linear):
            raise CheckpointError(f"{prefix}: a quantized tensor for a {type(linear).__name__}, not a linear layer; "
                                  "infopt rebuilds nn.Linear layers")
        model.set_submodule(prefix, build(tensors, prefix, fmt, linear.in_features, linear.out_features, opts))
    owned = set(prefixes)
    for key in tensors.keys():
        if key.rpartition(".")[0] not in owned:
            set_dense(model, key, tensors.get(key), opts.dtype)
    tokenizer = None
    if with_tokenizer and ((folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(folder), local_files_only=True)
    return model, tokenizer


def _trim_heap() -> None:
    """Hand the heap the load freed back to the system (glibc keeps freed blocks for reuse: after a large file's
    layers are decoded, hundreds of MB of them stay resident with nothing in them). No-op elsewhere."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


@register_quantized_loader  # what infopt.models.load_default(quantized=True) calls
def load_quantized(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu", tokenizer: bool = True, reference: bool = False,
                   activations: str = "float", mmap: bool = True):
    """Load a community quantized checkpoint onto infopt's int4/int8 layers, with no GPTQ/AWQ backend installed.

    Formats (see ``docs/quantize.md``, "Community checkpoints"):

    - GPTQ folders (``quant_method: gptq``, v1 or v2 zero points, act-order included): 4 bits ->
      :class:`~infopt.quantize.Int4Linear`, 8 bits -> :class:`~infopt.quantize.Int8Linear`;
    - AWQ GEMM folders (``quant_method: awq``, ``version: gemm``) -> ``Int4Linear``;
    - GGUF files: Q4_0, Q4_1, Q4_K -> ``Int4Linear`` (group 32), Q8_0 -> ``Int8Linear`` (group 32), Q6_K ->
      ``Int8Linear`` (group 16), F32/F16/BF16 dense. The codes map exactly, and so do the scales of Q8_0 and
      Q6_K, and with ``activations="int8"`` (``"auto"`` on CPUs with the kernels) those of Q4_0 and Q4_K too: the
      layers compute with the very weights the file holds. The float-activation int4 kernels hold bf16 scales and
      round the file's (lossy: up to 0.4% of a group's scale); ``reference=True`` keeps them in fp32.

    The model is built with empty weights and each quantized layer filled from the file's codes; no dense copy
    of a quantized matrix is made (embeddings and norms are dense in ``dtype``). Neither gptqmodel, auto-gptq nor
    autoawq is imported.

    Args:
        path: a GGUF file, or a folder with ``config.json`` + safetensors (GPTQ/AWQ) or exactly one ``.gguf``.
        dtype: the model's floating-point dtype (norms, embeddings, activations between layers).
        device: where the model goes (int4 layers repack for the device's kernel).
        tokenizer: also load the tokenizer (from the folder, or from the GGUF file's vocabulary).
        reference: build the layers on their reference paths (int4 ``plain`` layout, int8 fp32 compute): the
            checkpoint's own arithmetic in fp32, for checking; slow.
        activations: ``"float"`` (default): the layers multiply floating-point activations; ``"int8"``: the layers
            that fit it take int8 activations (the ``a8`` layouts, group scales included), and a GGUF file whose
            Q8_0 or Q6_K embedding the head is tied to gets an int8 head over those codes that the embedding reads its
            rows from: the layers
            ``cpu-fast`` builds, from the file's weights, with no float copy of the embedding; ``"auto"``: ``"int8"``
            where the CPU has the kernel (:func:`infopt.quantize.formats.a8.resolve`). A lossy step beyond the
            file's weights (activations rounded to 8 bits, as llama.cpp does).
        mmap: a GGUF file's large dense tensors that are already in ``dtype`` (an untied F32 embedding, F16
            weights in an fp16 model) stay private copy-on-write mappings of the file, as llama.cpp maps its files:
            no copy at the load, and only the pages read count in the resident set (an embedding's lookups read a
            few rows a token). The model never writes the file (a write copies the page), but the file must not be
            truncated or rewritten in place while the model lives: a truncated file faults (SIGBUS) on the next
            read. ``False`` copies them into the process's memory. Ignored by GPTQ/AWQ folders.

    Returns:
        ``(model, tokenizer)``; the tokenizer is None when not asked for or the folder has none. The model is in
        eval mode; ``model.infopt_source`` says what was loaded and how long it took. Its ``save_pretrained``
        writes infopt's ``quantization_config``, so the saved folder loads back with plain ``from_pretrained``
        (after ``import infopt``) on the same layers.

    Raises:
        FileNotFoundError: no such path.
        CheckpointError: an unsupported format, bit width, AWQ version or GGUF type (named), or tensors missing
            or of the wrong shape.
        MissingBackendError: a GGUF file without the ``gguf`` package (``pip install 'infopt[gguf]'``).

    Example:
        >>> import infopt
        >>> model, tok = infopt.load_quantized("model-Q4_K_M.gguf")  # doctest: +SKIP
        >>> type(model.model.layers[0].mlp.up_proj).__name__  # doctest: +SKIP
        'Int4Linear'
    """
    t0 = time.perf_counter()
    p = Path(path)
    fmt = detect_format(p)
    if activations not in a8.ACTIVATIONS:
        raise ValueError(f"load_quantized: activations={activations!r}; allowed: {', '.join(a8.ACTIVATIONS)}")
    opts = LoadOptions(dtype, reference, a8.resolve(activations, torch.device(device)), map_dense=bool(mmap))
    if fmt == "gguf":
        from .gguf_ckpt import load_gguf

        if p.is_dir():
            p = next(iter(sorted(p.glob("*.gguf"))))
        model, tok = load_gguf(p, opts, with_tokenizer=tokenizer)
    else:
        model, tok = _load_folder(p, fmt, opts, with_tokenizer=tokenizer)
    model = finish_model(model, device=device, source=str(p))
    _trim_heap()
    # save_pretrained then writes infopt's quantization_config, so plain from_pretrained (with import infopt) rebuilds
    # these layers
    install_save_hook(model, step="load_quantized")
    model.infopt_source = {"path": str(p), "format": fmt, "seconds": round(time.perf_counter() - t0, 3)}
    log.info("loaded %s (%s) in %.1f s", p, fmt, model.infopt_source["seconds"])
    return model, tok
