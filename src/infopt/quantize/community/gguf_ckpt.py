"""GGUF files (llama.cpp) loaded onto infopt's int4/int8 layers, block by block, with no dense copy of a quantized matrix.

The file is read with ``gguf.GGUFReader`` (a memory map). The config and the tensor names come from
transformers' own GGUF tables (``GGUF_TO_TRANSFORMERS_MAPPING``, ``get_gguf_hf_weights_map``), the
tokenizer from transformers' GGUF tokenizer conversion, and the model is built with empty weights
(:func:`~infopt.quantize.community.common.empty_model`). Then each tensor goes where it belongs:

- a linear weight in Q4_0, Q4_1 or Q4_K -> :class:`~infopt.quantize.Int4Linear`, group 32; in Q8_0 ->
  :class:`~infopt.quantize.Int8Linear`, group 32; in Q6_K -> ``Int8Linear``, group 16 (see
  :mod:`~infopt.quantize.community.gguf_blocks` for the exact formulas); with ``activations="int8"`` every one of
  them takes int8 activations where its shape fits the a8 kernels, which apply the group scales as they are;
- F32, F16 and BF16 tensors, and every non-linear tensor (embeddings, norms) -> dense, in the model's dtype
  (a quantized embedding is dequantized: a lookup reads one row, and a tied head reads it dense), except that with
  ``activations="int8"`` a Q8_0 or Q6_K embedding the head is tied to becomes the int8 head, whose codes the
  embedding's lookups read (``share_embedding``'s layers), and an untied embedding in any block type keeps its blocks
  (:class:`~infopt.quantize.community.gguf_embedding.BlockEmbedding`: a lookup decodes its rows);
- llama.cpp stores Llama's q/k rows permuted for its rotary layout and transformers' loader permutes them back
  (``LlamaTensorProcessor``); a quantized matrix's rows carry their own scales, so the same row permutation
  applies to codes, scales and zero points;
- a rotary scaling (``linear`` metadata, llama3's ``rope_freqs.weight``) becomes the config's, checked against the
  file (:mod:`~infopt.quantize.community.gguf_rope`); any other is refused.

With ``activations="int8"`` (``cpu-fast``'s layers), Q4_0, Q4_1, Q4_K, Q8_0 and Q6_K blocks go through a C++ transcoder
straight into the layers' a8 layouts (:func:`_transcoded`), on background threads that start as soon as the file's
header is read (:class:`_Ahead`): they work while this thread imports and builds the model's classes (about 3 s of
transformers' own imports), which they need no part of.

A large F32/F16 tensor already in the model's dtype (an untied embedding the export wrote dense: 2.1 GB at Llama 3.1
8B) is not copied: the parameter is a copy-on-write mapping of the file's bytes (:func:`_mapped`, ``mmap=True``, the
default), read as it is touched.

Any other quantized type in a linear raises :class:`~infopt.core.errors.CheckpointError` naming the tensor.
"""

from __future__ import annotations

import logging
import mmap
import sys
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ...core.availability import require
from ...core.errors import CheckpointError
from ..formats.int4 import Int4Linear
from ..formats.int4_layouts import LAYOUTS as INT4_LAYOUTS
from ..formats.int8 import Int8Linear, SharedInt8Embedding
from ..formats.int8_layouts import LAYOUTS as INT8_LAYOUTS
from .common import (
    LoadOptions,
    empty_model,
    gemma3_attention_scalar,
    int4_layer,
    int8_layer,
    per_channel_if_uniform,
    set_dense,
)
from .gguf_blocks import (
    A8_INT4,
    A8_INT8,
    BLOCKS,
    Int4Blocks,
    Int8Blocks,
    a8_int4,
    a8_int8,
    a8_k_int4,
    decode_int4,
    decode_int8,
    decode_q4_0,
    dequantize_blocks,
    q6_k_parts,
    q6_k_scales,
    q8_0_scales,
)
from .gguf_embedding import BlockEmbedding
from .gguf_rope import FREQS_TENSOR, check_rope, rope_from_gguf

__all__ = ["load_gguf", "gguf_config", "gguf_tokenizer", "SUPPORTED_LINEAR_TYPES"]

log = logging.getLogger(__name__)

SUPPORTED_LINEAR_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q6_K", "F32", "F16", "BF16")
"""GGUF tensor types a linear layer can be stored in."""

_FLOAT = ("F32", "F16", "BF16")
_ROWS_PER_SLICE = 4096  # embedding rows decoded at once: fp32 transients of 4096 x hidden, not of the whole vocabulary
# transformers' per-architecture tensor processors that leave a quantized linear weight alone (the Gemma/Nemotron
# ones rewrite norm weights only, which are never quantized) or permute its rows (Llama)
_SAFE_PROCESSORS = ("TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor", "NemotronTensorProcessor")


def _reader(path: str, *, skip_arrays: int | None = None):
    """A ``gguf.GGUFReader`` whose header walk slices a plain ndarray view of the memory map: ``np.memmap``'s
    per-slice bookkeeping is two thirds of the reader's time on a 49k-token vocabulary (2 s -> 0.7 s on the
    default model); tensors are the same views of the file.

    ``skip_arrays``: metadata arrays longer than this are stepped over, not parsed (a 152k-token vocabulary and its
    merges are 350k fields' parts and 3.3 s of a 0.5B file's load); such a field keeps its element type and its
    length (``len(field.data)``) but no values. The loader reads no vocabulary (the tokenizer reads the file on its
    own), so it skips them."""
    from gguf import GGUFReader, GGUFValueType

    class _Reader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _get_field_parts(self, orig_offs, raw_type):
            if skip_arrays is None or GGUFValueType(raw_type) != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            itype, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            if int(count[0]) <= skip_arrays:
                return super()._get_field_parts(orig_offs, raw_type)
            offs, kind = orig_offs + 12, GGUFValueType(int(itype[0]))
            if kind == GGUFValueType.STRING:  # each element: a uint64 length, then that many bytes
                order = "big" if self.byte_order == "S" and sys.byteorder == "little" else "little"
                view = memoryview(self._get(0, np.uint8, len(self.data)))
                for _ in range(int(count[0])):
                    offs += 8 + int.from_bytes(view[offs:offs + 8], order)
            elif kind in self.gguf_scalar_to_np:
                offs += np.dtype(self.gguf_scalar_to_np[kind]).itemsize * int(count[0])
            else:  # nested arrays: no fast step; parse them
                return super()._get_field_parts(orig_offs, raw_type)
            return offs - orig_offs, [itype, count], range(int(count[0])), [GGUFValueType.ARRAY, kind]

    return _Reader(path)


def _value(field) -> Any:
    from transformers.modeling_gguf_pytorch_utils import _gguf_parse_value

    value = [_gguf_parse_value(field.parts[i], field.types) for i in field.data]
    return value[0] if len(value) == 1 else value


def _tied(reader, arch: str) -> bool:
    """Whether the head is the token embedding: the file has no output tensor (transformers' rule, which also ties
    two architectures whatever the file holds)."""
    return all(t.name != "output.weight" for t in reader.tensors) or arch in ("falcon", "bloom")


def gguf_config(reader, source: str) -> dict[str, Any]:
    """The transformers config dict of a GGUF file, as ``AutoConfig.from_pretrained(dir, gguf_file=...)`` builds it
    for decoder-only models, parsing only the keys the config needs (not the vocabulary, which takes seconds).

    Raises:
        CheckpointError: an architecture transformers has no GGUF mapping for.
    """
    from transformers.modeling_gguf_pytorch_utils import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_TO_TRANSFORMERS_MAPPING

    mapping = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    fields = reader.fields
    if "general.architecture" not in fields:
        raise CheckpointError(f"{source}: no general.architecture in its metadata; not a model GGUF file")
    arch = _value(fields["general.architecture"])
    name = _value(fields["general.name"]) if "general.name" in fields else ""
    names = name if isinstance(name, list) else [name]
    updated = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}.get(arch, arch)
    if "llama" in arch and "mistral" in names:  # llama.cpp writes Mistral models as llama (transformers' rule)
        updated = "mistral"
    if arch not in mapping and updated not in mapping:
        raise CheckpointError(f"{source}: GGUF architecture {arch!r} has no transformers GGUF mapping; supported: "
                              f"{', '.join(k for k in mapping if k not in ('general', 'tokenizer'))}")
    cfg: dict[str, Any] = {"tie_word_embeddings": _tied(reader, arch)}
    for k, v in (GGUF_CONFIG_DEFAULTS_MAPPING.get(updated) or GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {}).items():
        cfg.setdefault(k, v)
    for key, field in fields.items():
        prefix, _, rest = key.replace(arch, updated).partition(".")
        renames = mapping.get(prefix)
        if not renames or rest not in renames or renames[rest] in (None, -1):
            continue
        value = _value(field)
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, updated)
        cfg[renames[rest]] = value
    # a head's size as llama.cpp takes it: key_length, else hidden / heads (transformers' qwen3 and llama tables skip
    # the key, and a Qwen3 config's default head_dim is 128 whatever the file's shapes)
    key_length = fields.get(f"{arch}.attention.key_length")
    if "head_dim" not in cfg:
        if key_length is not None:
            cfg["head_dim"] = int(_value(key_length))
        elif cfg.get("hidden_size") and cfg.get("num_attention_heads"):
            cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    if cfg.get("model_type") == "gemma3":
        cfg["model_type"] = "gemma3_text"
        _gemma3_config(cfg, fields, arch)
    if "vocab_size" not in cfg and "tokenizer.ggml.tokens" in fields:
        cfg["vocab_size"] = len(fields["tokenizer.ggml.tokens"].data)
    scaling = {key[len(arch) + 1:]: _value(field) for key, field in fields.items()
               if key.startswith(f"{arch}.rope.scaling.")}
    rope_from_gguf(cfg, arch, scaling, _rope_divisors(reader), source)
    return cfg


def _gemma3_config(cfg: dict[str, Any], fields, arch: str) -> None:
    """What llama.cpp's Gemma 3 graph fixes rather than reads, set in the config (transformers' GGUF table leaves
    them to the config class's defaults, which are one checkpoint's): the attention scale
    (:func:`~infopt.quantize.community.common.gemma3_attention_scalar`), a final logit soft-cap where the file has
    one."""
    heads, hidden, head_dim = cfg.get("num_attention_heads"), cfg.get("hidden_size"), cfg.get("head_dim")
    if heads and hidden and head_dim:  # head_dim: set by gguf_config from the file
        cfg["query_pre_attn_scalar"] = gemma3_attention_scalar(cfg.get("num_hidden_layers"), hidden, heads, head_dim)
    cap = fields.get(f"{arch}.final_logit_softcapping")
    if cap is not None:
        cfg["final_logit_softcapping"] = float(_value(cap))


def _rope_divisors(reader) -> np.ndarray | None:
    t = next((t for t in reader.tensors if t.name == FREQS_TENSOR), None)
    return None if t is None else np.array(t.data, dtype=np.float32)


def gguf_tokenizer(path: Path):
    """The file's tokenizer through transformers' GGUF tokenizer conversion (``PreTrainedTokenizerFast`` with
    ``gguf_file``: the backend ``AutoTokenizer`` builds for GGUF files, without re-reading the config)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)


def _release(reader, t) -> None:
    """Drop the file pages of tensor ``t`` from the process once its layer holds its own copy: they are clean pages
    of a read-only mapping (read again from the file if touched), but until dropped they count in the resident set,
    so a load's peak would hold the whole file beside the model it builds."""
    mm = getattr(reader.data, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = int(t.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
    end = int(t.data_offset) + int(t.n_bytes)
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, end - start)
    except (OSError, ValueError):  # advice only: a platform that refuses it keeps the pages
        pass


def _qk_perm(rows: int, heads: int) -> torch.Tensor:
    # transformers' reverse_permute: rows (head, dim, 2) -> (head, 2, dim), as a gather index
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def _raw(t) -> torch.Tensor:
    """The tensor's bytes (or values) as a view of the read-only memory map, not a copy (a 152k-token Q8_0
    embedding: 145 MB less at the load's peak). Read only: every decoder makes new tensors from it (writing into it
    would fault), and its pages are dropped by :func:`_release` once decoded."""
    with warnings.catch_warnings():  # torch warns that the array is not writable: it is only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(t.data)


_MAP_BYTES = 16 << 20  # dense tensors this large (an untied embedding, a float head) are mapped, not copied
_NP_DTYPES = {torch.float32: np.float32, torch.float16: np.float16}


def _mapped(path: Path, t, shape: tuple[int, ...]) -> np.ndarray:
    """Tensor ``t``'s values as a private copy-on-write mapping of its bytes in the file: no copy is made and no
    page is read until touched (an embedding's lookups read a few rows a token), and the resident set counts only
    the pages read, which the kernel may drop again under memory pressure (they are clean file pages). Writes go
    to the process's own copy of a page; the file never changes. Its own mapping (not the reader's, which maps the
    whole file read only): only this tensor's bytes are committed, and it outlives the reader."""
    start, size = int(t.data_offset), int(t.n_bytes)
    base = start // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), start + size - base, access=mmap.ACCESS_COPY, offset=base)
    return np.frombuffer(mm, dtype=t.data.dtype, count=t.data.size, offset=start - base).reshape(shape)


def _file_array(t, shape: tuple[int, ...], path: Path | None) -> np.ndarray:
    """Tensor ``t``'s stored values as an array of ``shape``: mapped from ``path`` (:func:`_mapped`) where one is
    given and the tensor is large, else a copy."""
    if path is not None and int(t.n_bytes) >= _MAP_BYTES and t.data.dtype.isnative:
        return _mapped(path, t, shape)
    return np.array(t.data).reshape(shape)


def _dense(t, dtype: torch.dtype, path: Path | None = None) -> np.ndarray | torch.Tensor:
    """Tensor ``t`` dense: a numpy array (F32/F16, for the tensor processor; mapped from ``path`` where it is large
    and already in ``dtype``, see :func:`_mapped`) or a tensor in ``dtype`` (decoded blocks)."""
    kind = t.tensor_type.name
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if kind in ("F32", "F16"):
        return _file_array(t, shape, path if t.data.dtype == _NP_DTYPES.get(dtype) else None)
    if kind == "BF16":  # numpy has no bfloat16: the processors get fp32
        return _raw(t).view(torch.int16).view(torch.bfloat16).float().numpy().reshape(shape)
    if kind in BLOCKS:  # an embedding: dense in the model's dtype, decoded a slice of rows at a time
        rows = shape[0] if len(shape) > 1 else 1
        data = t.data.reshape(rows, -1)
        out = torch.empty(rows, data.shape[1] // BLOCKS[kind][1] * BLOCKS[kind][0], dtype=dtype)
        for r in range(0, rows, _ROWS_PER_SLICE):
            out[r:r + _ROWS_PER_SLICE] = dequantize_blocks(torch.from_numpy(np.array(data[r:r + _ROWS_PER_SLICE])),
                                                           kind, dtype)
        return out.reshape(shape)
    from gguf import dequantize

    return np.asarray(dequantize(t.data, t.tensor_type)).reshape(shape)


def _processor(arch: str, cfg: dict[str, Any], source: str):
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    cls = TENSOR_PROCESSORS.get(arch, TensorProcessor)
    if cls.__name__ not in _SAFE_PROCESSORS:
        raise CheckpointError(f"{source}: architecture {arch!r}: transformers reshapes its GGUF tensors "
                              f"({cls.__name__}) in ways infopt does not apply to quantized blocks; load it dense "
                              "with AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)")
    return cls(config=cfg)


def _name_map(model: nn.Module, arch: str, num_layers: int, processor, source: str) -> dict[str, str]:
    """``{gguf tensor name: model parameter name}`` through gguf's ``TensorNameMap``, as transformers'
    ``get_gguf_hf_weights_map`` builds it, with one name table for the model instead of one per submodule."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_id = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
    if arch_id is None:
        raise CheckpointError(f"{source}: the installed gguf package does not know architecture {arch!r}; "
                              "pip install -U gguf")
    table = get_tensor_name_map(arch_id, num_layers)
    out: dict[str, str] = {}
    for key in model.state_dict():
        name = processor.preprocess_name(key)
        stem, suffix = name, ""
        if name.endswith((".weight", ".bias")):
            stem, _, suffix = name.rpartition(".")
            suffix = "." + suffix
        parts = stem.split(".")
        for i in range(len(parts)):  # "model.layers.0.mlp.up_proj", then "layers.0.mlp.up_proj", ...
            gguf_name = table.get_name(".".join(parts[i:]))
            if gguf_name is not None:
                out.setdefault(gguf_name + suffix, key)
                break
    return out


def _transcoded(raw: torch.Tensor, kind: str, rows: int, in_f: int, perm: torch.Tensor | None,
                opts: LoadOptions) -> nn.Module | None:
    """``cpu-fast``'s layer for Q4_0 / Q4_1 / Q4_K / Q8_0 / Q6_K blocks, written by the C++ transcoder straight into
    the a8 layouts (:func:`~infopt.quantize.community.gguf_blocks.a8_int4`, ``a8_int8``): the layer :func:`int4_layer`
    / :func:`int8_layer` build from the decoded codes, bit for bit, in one pass over the file's bytes (Q8_0 and Q6_K
    scales that differ within a row stay per group of 32 and 16). None where it does not apply (other activations or
    types, shapes the layouts do not take, no C++ kernels): the caller decodes as usual."""
    if opts.activations != "int8":
        return None
    if kind == "Q4_K" and INT4_LAYOUTS["a8_k"].fits(rows, in_f, 32) is None:  # the file's two-level scales as they are
        weight, scale_min = a8_k_int4(raw, perm)
        return Int4Linear.from_packed("a8_k", {"weight_packed": weight, "scale_min": scale_min}, in_features=in_f,
                                      out_features=rows, group_size=32, dtype=opts.dtype)
    if kind in A8_INT4 and INT4_LAYOUTS["a8"].fits(rows, in_f, 32) is None:
        layout = "a8_sym" if kind == "Q4_0" else "a8"  # Q4_0's codes are symmetric: its fp16 scales kept alone
        packed = a8_int4(raw, kind, perm, symmetric=layout == "a8_sym")
        return None if packed is None else Int4Linear.from_packed(
            layout, {"weight_packed": packed[0], "scale_min": packed[1]}, in_features=in_f, out_features=rows,
            group_size=32, dtype=opts.dtype)
    if kind in A8_INT8 and INT8_LAYOUTS["a8"].fits(rows, in_f, 32 if kind == "Q8_0" else 16) is None:
        k6 = q6_k_parts(raw) if kind == "Q6_K" else None  # (d, sc): kept as they are, the layer need not factor
        scales = q8_0_scales(raw) if kind == "Q8_0" else q6_k_scales(raw, k6)
        if perm is not None:
            scales = scales[perm]
            k6 = None if k6 is None else (k6[0][perm], k6[1][perm])
        scales = per_channel_if_uniform(scales)  # as int8_layer does
        weight = a8_int8(raw, perm, kind)
        return None if weight is None else Int8Linear.from_a8(weight, scales, dtype=opts.dtype,
                                                              k6=k6 if scales.dim() == 2 else None)
    return None


class _Ahead:
    """The layers :func:`_transcoded` builds, computed on background threads (as many as torch's) in file order while
    the loader's thread imports and builds the model (the C++ transcoder releases the GIL). Taken are the 2-D Q4_0 / Q4_1 / Q4_K /
    Q8_0 / Q6_K ``blk.*.weight`` tensors (every linear of a decoder layer), and the token embedding in Q8_0 or Q6_K
    where the head is tied to it (``cpu-fast``'s shared int8 head); not q and k, whose rows may need the permutation
    only the tensor processor says (the loader's thread transcodes them when it meets them). A tensor that is no linear after all, or
    whose shape does not fit the model's layer, is only wasted work: the loader checks each before it takes it, and a
    layer it does not take is dropped. Each tensor's file pages are released once transcoded (:func:`_release`), so
    the resident set holds what a load in order holds; a tensor that finds no layer (None) keeps them, to be decoded.
    """

    KINDS = (*A8_INT4, *A8_INT8)

    def __init__(self, reader, opts: LoadOptions, tied: bool):
        # one worker a thread torch may use: once the imports are done the loader's thread only waits for them
        self._pool = ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="infopt-gguf")
        self._jobs: dict[str, Future] = {}
        for t in reader.tensors:
            if self._takes(t, tied):  # the views made here: _raw's warning filter is not for two threads at once
                self._jobs[t.name] = self._pool.submit(self._build, reader, t, _raw(t), opts)

    @classmethod
    def _takes(cls, t, tied: bool) -> bool:
        kind, name = t.tensor_type.name, t.name
        if kind not in cls.KINDS or len(t.shape) != 2:
            return False
        if name == "token_embd.weight":
            return tied and kind in A8_INT8
        return name.startswith("blk.") and name.endswith(".weight") and ".attn_q." not in name and \
            ".attn_k." not in name

    @staticmethod
    def _build(reader, t, raw: torch.Tensor, opts: LoadOptions) -> nn.Module | None:
        rows, in_f = (int(d) for d in reversed(t.shape.tolist()))
        layer = _transcoded(raw.view(rows, -1), t.tensor_type.name, rows, in_f, None, opts)
        if layer is not None:
            _release(reader, t)
        return layer

    def take(self, t) -> tuple[bool, nn.Module | None]:
        """``(taken, layer)``: whether tensor ``t`` was taken, and its layer (waiting for it; None where
        :func:`_transcoded` found none, so the caller decodes without asking it again). Raises what transcoding it
        raised."""
        job = self._jobs.pop(t.name, None)
        return (False, None) if job is None else (True, job.result())

    def close(self) -> None:
        """Stop: what was not started is cancelled, what runs is waited for."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def _quantized_linear(t, kind: str, module: nn.Linear, perm: torch.Tensor | None, opts: LoadOptions,
                      hf_name: str, ahead: _Ahead | None = None) -> nn.Module:
    rows, in_f = module.out_features, module.in_features
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if shape != (rows, in_f):
        raise CheckpointError(f"{t.name} -> {hf_name}: GGUF shape {shape}, the model's layer is {(rows, in_f)}")
    raw = _raw(t).view(rows, -1)
    taken, layer = ahead.take(t) if ahead is not None and perm is None else (False, None)
    if not taken:
        layer = _transcoded(raw, kind, rows, in_f, perm, opts)
    if layer is None and kind == "Q4_0" and opts.activations == "int8" and \
            INT4_LAYOUTS["a8"].fits(rows, in_f, 32) is None:  # as the transcoder writes it: the fp16 scales alone
        codes, scales = decode_q4_0(raw)
        if perm is not None:
            codes, scales = codes[perm], scales[perm]
        layer = Int4Linear.from_codes(codes, scales, torch.full_like(scales, 8.0), group_size=32, dtype=opts.dtype,
                                      layout="a8_sym")
    elif layer is None and kind in Int4Blocks:
        codes, scales, zeros = decode_int4(raw, kind)
        if perm is not None:
            codes, scales, zeros = codes[perm], scales[perm], zeros[perm]
        layer = int4_layer(codes, scales, zeros, 32, opts)
    elif layer is None:
        codes, scales, _group = decode_int8(raw, kind)
        if perm is not None:
            codes, scales = codes[perm], scales[perm]
        layer = int8_layer(codes, scales, opts)
    if module.bias is not None:  # read already, or filled later (a missing one is caught as still on meta)
        layer.bias = module.bias if not module.bias.is_meta else nn.Parameter(
            torch.empty(rows, dtype=opts.dtype, device="meta"), requires_grad=False)
    return layer


def _shared_head(model: nn.Module, t, kind: str, opts: LoadOptions,
                 ahead: _Ahead | None = None) -> SharedInt8Embedding | None:
    """The int8 head built from a tied embedding's Q8_0 or Q6_K blocks and the embedding that reads them, or None
    for other blocks or an embedding that cannot read a head's rows (it is then loaded dense, as usual)."""
    if kind not in Int8Blocks:
        return None
    emb = model.get_input_embeddings()
    rows, dim = _embedding_shape(t, emb)
    raw = _raw(t).view(rows, -1)
    taken, head = ahead.take(t) if ahead is not None else (False, None)
    if not taken:
        head = _transcoded(raw, kind, rows, dim, None, opts)
    if head is None:
        codes, scales, _group = decode_int8(raw, kind)
        head = int8_layer(codes, scales, opts)
    return SharedInt8Embedding.for_head(head, emb)


def _embedding_shape(t, embedding: nn.Module) -> tuple[int, int]:
    """``(rows, dim)`` of ``embedding``, checked against tensor ``t``'s shape in the file."""
    rows, dim = embedding.num_embeddings, embedding.embedding_dim
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if shape != (rows, dim):
        raise CheckpointError(f"{t.name}: GGUF shape {shape}, the model's embedding is {(rows, dim)}")
    return rows, dim


def _block_embedding(path: Path, t, kind: str, embedding: nn.Module, opts: LoadOptions) -> BlockEmbedding | None:
    """The untied embedding over tensor ``t``'s blocks (mapped from the file where ``opts.map_dense`` and it is large,
    else copied), or None where :meth:`BlockEmbedding.for_embedding` says no (it is then loaded dense)."""
    rows, _ = _embedding_shape(t, embedding)
    blocks = _file_array(t, (rows, -1), path if opts.map_dense else None)
    return BlockEmbedding.for_embedding(torch.from_numpy(blocks), kind, embedding)


def load_gguf(path: Path, opts: LoadOptions, *, with_tokenizer: bool = True):
    """Build ``(model, tokenizer)`` from one GGUF file (see the module docstring). The model is on the CPU.

    Raises:
        MissingBackendError: the ``gguf`` package is not installed.
        CheckpointError: an unsupported architecture or linear tensor type, or tensors that do not fit the config.
    """
    require("gguf", feature=f"reading {path.name}")
    source = str(path)
    try:
        reader = _reader(source, skip_arrays=1024)
    except (ValueError, OSError) as err:
        raise CheckpointError(f"{source}: not a readable GGUF file ({err})") from err
    # started before the config is parsed (which imports transformers' GGUF tables): the architecture's name is read
    # from its bytes here, for the tie only (a wrong guess transcodes the embedding for nothing)
    field = reader.fields.get("general.architecture")
    arch = "" if field is None else bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    ahead = _Ahead(reader, opts, _tied(reader, arch)) if opts.activations == "int8" else None
    try:
        cfg = gguf_config(reader, source)
        arch = _value(reader.fields["general.architecture"])
        divisors = _rope_divisors(reader)
        # the metadata's Python objects (a 152k-token vocabulary and its merges: ~160 MB of them) are done with once
        # the config is read (the tokenizer reads the file on its own): freed before the weights are decoded
        reader.fields.clear()
        return _fill(path, reader, cfg, arch, divisors, opts, ahead, with_tokenizer)
    finally:
        if ahead is not None:
            ahead.close()


def _fill(path: Path, reader, cfg: dict[str, Any], arch: str, divisors, opts: LoadOptions, ahead: _Ahead | None,
          with_tokenizer: bool):
    from transformers import AutoConfig

    source = str(path)
    processor = _processor(arch, cfg, source)
    config = AutoConfig.for_model(**cfg)
    config.name_or_path = str(path.parent)  # as from_pretrained(folder, gguf_file=...) sets it
    check_rope(config, divisors, source)
    model = empty_model(config, opts.dtype)
    name_map = _name_map(model, arch, config.num_hidden_layers, processor, source)
    linears = {fqn: m for fqn, m in model.named_modules() if type(m) is nn.Linear}
    heads = {"q": cfg.get("num_attention_heads"), "k": cfg.get("num_key_value_heads")}
    # cpu-fast's layers: a quantized embedding the head is tied to (no output tensor) becomes the int8 head, and the
    # embedding reads its rows from the head's codes, as share_embedding does
    shared_head = opts.activations == "int8" and bool(cfg.get("tie_word_embeddings"))
    # an untied quantized embedding keeps its blocks (cpu-fast's layers only, as the shared head above)
    block_embedding = opts.activations == "int8" and not cfg.get("tie_word_embeddings")
    embedding = model.get_input_embeddings()
    embed_name = next((n for n, m in model.named_modules() if m is embedding), "") + ".weight"
    permute_qk = type(processor).__name__ == "LlamaTensorProcessor" and None not in heads.values()
    for t in reader.tensors:
        hf_name = name_map.get(t.name)
        if hf_name is None:
            log.debug("%s: tensor %s has no place in %s; skipped (as transformers does)", source, t.name,
                      type(model).__name__)
            continue
        kind = t.tensor_type.name
        owner, _, attr = hf_name.rpartition(".")
        if owner in linears and attr == "weight" and kind not in _FLOAT:
            if kind not in SUPPORTED_LINEAR_TYPES:
                raise CheckpointError(
                    f"{source}: {t.name} ({hf_name}) is {kind}; infopt maps {', '.join(SUPPORTED_LINEAR_TYPES)} "
                    "onto its layers. Load this file dense with AutoModelForCausalLM.from_pretrained(folder, "
                    "gguf_file=...), or pick a Q4_0/Q4_1/Q4_K_M/Q8_0 file")
            perm = None
            if permute_qk and (".attn_q." in t.name or ".attn_k." in t.name):
                perm = _qk_perm(linears[owner].out_features, heads["q" if ".attn_q." in t.name else "k"])
            model.set_submodule(owner, _quantized_linear(t, kind, linears[owner], perm, opts, hf_name, ahead))
            _release(reader, t)
            continue
        if (shared_head and hf_name == embed_name and kind not in _FLOAT
                and (shared := _shared_head(model, t, kind, opts, ahead)) is not None):
            model.set_output_embeddings(shared.head)
            model.set_input_embeddings(shared)
            _release(reader, t)
            continue
        if (block_embedding and hf_name == embed_name and kind in BLOCKS
                and (blocks := _block_embedding(path, t, kind, embedding, opts)) is not None):
            model.set_input_embeddings(blocks)
            _release(reader, t)
            continue
        weights = _dense(t, opts.dtype, path if opts.map_dense else None)
        if isinstance(weights, np.ndarray):
            weights = torch.from_numpy(np.ascontiguousarray(processor.process(weights=weights, name=t.name).weights))
        elif permute_qk and (".attn_q." in t.name or ".attn_k." in t.name):  # a quantized q/k that is no linear
            weights = weights[_qk_perm(weights.shape[0], heads["q" if ".attn_q." in t.name else "k"])]
        set_dense(model, hf_name, weights, opts.dtype)
        _release(reader, t)
    tokenizer = gguf_tokenizer(path) if with_tokenizer else None
    return model, tokenizer
