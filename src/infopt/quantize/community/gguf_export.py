"""Write a model, optimized or not, as a GGUF file that llama.cpp (and :func:`infopt.load_quantized`) loads.

What goes where:

- each decoder linear: a float weight is quantized to ``type`` with llama.cpp's own reference rounding (the ``gguf``
  package's ``quants.quantize``, the same per-block formulas as ``llama-quantize``'s reference path); an
  :class:`~infopt.quantize.Int4Linear` with groups of 32 keeps its codes: symmetric ones (every zero point 8) as
  Q4_0, others as Q4_1 (``w = code * d + m`` with ``d = scale``, ``m = -zero * scale``); an
  :class:`~infopt.quantize.Int8Linear` (any layout, per-channel scales or groups of a multiple of 32) as Q8_0. Those
  codes map exactly; each block's scale (and
  Q4_1's minimum) is stored in fp16, exact where it came from an fp16 value (a model loaded from a GGUF file) and
  rounded otherwise: the report lists both kinds. A Q4_K file's int4 layer, whose scales ``d * sc`` Q4_1's fp16
  fields would round, goes out as Q4_K with its two levels (held as they are by the ``a8_k`` layout, found exactly by
  :func:`~infopt.quantize.formats.int4_layouts.factor_k_scales` on the reference layout), and a Q6_K file's int8
  layer (groups of 16, 6-bit codes) as Q6_K: exact, so a Q4_K_M file loaded and written again holds the same weights.
  Any other quantized layer is dequantized and quantized again to ``type`` (listed as requantized);
- a head not tied to the embeddings as the linears are; the embeddings in ``float_type``, except an int8 head shared
  with the embeddings (``cpu-fast``'s :class:`~infopt.quantize.formats.int8.SharedInt8Embedding`): its codes become
  the Q8_0 token embedding, which llama.cpp also reads as the output layer, as infopt does; norms and biases in
  F32. A layer in a kernel layout holds its scales in bf16 (``cpu_int4pack``, ``cuda_tinygemm``): they fit fp16
  exactly, but a model loaded from a GGUF file that way has already rounded the file's fp16 scales to bf16; load
  it with ``reference=True`` to write the file's own blocks back;
- Llama's q/k rows permuted into llama.cpp's rotary order (the inverse of what the loaders undo);
- Gemma 3's norm weights as llama.cpp multiplies them: ``1 + w`` (transformers' Gemma norms scale by ``1 + w``,
  llama.cpp's by the stored weight; the loaders subtract the 1 again), in fp32: exact where ``w`` has no bits below
  2^-23 (a bf16-trained weight);
- a linear or llama3 rotary scaling as llama.cpp reads it (:mod:`~infopt.quantize.community.gguf_rope`);
- the config as the architecture's GGUF keys (transformers' own GGUF table read backwards) and, given a tokenizer,
  its BPE vocabulary, merges, special tokens and chat template.

Architectures: ``llama`` (SmolLM2, Llama 2/3, ...), ``qwen2``, ``qwen3`` and ``gemma3`` (text models; what
llama.cpp fixes for Gemma 3 rather than reads, the model must have: see :func:`_check_gemma3`).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ...core.availability import require
from ...core.errors import CheckpointError
from ..formats import a8
from ..formats.int4 import Int4Linear
from ..formats.int4_layouts import factor_k_scales
from ..formats.int8 import Int8Linear, SharedInt8Embedding
from ..formats.int8_layouts import factor_k6_scales
from ..formats.primitives import unpack_int4
from .common import gemma3_attention_scalar
from .gguf_embedding import BlockEmbedding
from .gguf_rope import FREQS_TENSOR, _head_dim, export_rope, rope_parameters

__all__ = ["export_gguf", "EXPORT_TYPES", "FLOAT_TYPES"]

log = logging.getLogger(__name__)

EXPORT_TYPES = ("Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "F32")
"""GGUF types :func:`export_gguf` writes float linears in."""
FLOAT_TYPES = ("F16", "BF16", "F32")
"""GGUF types embeddings (and an untied float head) may be written in."""
ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
"""``config.model_type`` -> GGUF architecture written."""
BLOCK = 32  # weights per Q4_0 / Q4_1 / Q8_0 block


def _numpy_float(t: torch.Tensor, kind: str) -> tuple[np.ndarray, Any]:
    """``(array, raw_dtype)`` of a float tensor in the GGUF float type ``kind``."""
    from gguf import GGMLQuantizationType as Q

    if kind == "F32":
        return t.detach().float().cpu().numpy(), None
    if kind == "F16":
        return t.detach().to(torch.float16).cpu().numpy(), None
    # BF16: numpy has no bfloat16; the raw 16-bit patterns, typed for the writer
    return t.detach().to(torch.bfloat16).cpu().view(torch.int16).numpy().view(np.uint8).reshape(
        *t.shape[:-1], t.shape[-1] * 2), Q.BF16


def _fp16_exact(t: torch.Tensor, slack: float = 0.0) -> bool:
    """Whether fp16 holds ``t``, to within ``slack`` relative (fp32 rounding of a value derived from fp16 ones)."""
    t = t.float()
    return bool(((t.to(torch.float16).float() - t).abs() <= slack * t.abs()).all())


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[rows, blocks, 32]`` codes -> ``[rows, blocks, 16]`` bytes: byte j holds code j (low) and j + 16 (high)."""
    c = codes.to(torch.uint8)
    return c[..., :16] | (c[..., 16:] << 4)


def _fp16_bytes(v: torch.Tensor) -> torch.Tensor:
    """``[rows, blocks]`` values -> ``[rows, blocks, 2]`` little-endian fp16 bytes."""
    return v.float().to(torch.float16).reshape(-1).contiguous().view(torch.uint8).view(*v.shape, 2)


def _int4_blocks(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[np.ndarray, str, bool]:
    """Q4_0 (every zero point 8) or Q4_1 blocks of int4 codes ``[out, in]`` in groups of 32: ``(bytes [out,
    blocks * size], type, exact)``; exact when the fp16 fields hold the layer's values unrounded."""
    rows = codes.shape[0]
    c = codes.view(rows, -1, BLOCK)
    qs = _pack_nibbles(c)
    if bool((zeros == 8).all()):
        kind, fields, exact = "Q4_0", [_fp16_bytes(scales)], _fp16_exact(scales)
    else:
        m = -zeros.float() * scales.float()
        kind, fields = "Q4_1", [_fp16_bytes(scales), _fp16_bytes(m)]
        # a layer loaded from Q4_1 holds the zero point -m / d: -z d gives m back to fp32 rounding
        exact = _fp16_exact(scales) and _fp16_exact(m, slack=2.0**-20)
    return torch.cat([*fields, qs], dim=-1).reshape(rows, -1).numpy(), kind, exact


def _int8_blocks(codes: torch.Tensor, scales: torch.Tensor) -> tuple[np.ndarray, bool]:
    """Q8_0 blocks of int8 codes ``[out, in]`` with scales ``[out, in // 32]``: ``(bytes, exact)``."""
    rows = codes.shape[0]
    q = codes.view(rows, -1, BLOCK).contiguous().view(torch.uint8)
    return torch.cat([_fp16_bytes(scales), q], dim=-1).reshape(rows, -1).numpy(), _fp16_exact(scales)


def _q4_k_blocks(codes: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor,
                 m: torch.Tensor) -> np.ndarray:
    """Q4_K blocks (``w = d * sc_j * q - dmin * m_j`` per 32 of a super-block of 256) of codes ``[out, in]`` 0..15
    with their two levels, ``d``, ``dmin`` fp16 ``[out, in / 256]``, ``sc``, ``m`` ``[out, in / 32]`` 0..63: bytes
    ``[out, in / 256 * 144]``, the inverse of the loader's reading (``gguf_blocks.decode_int4``)."""
    rows = codes.shape[0]
    sc, m = sc.to(torch.uint8).view(rows, -1, 8), m.to(torch.uint8).view(rows, -1, 8)
    lo_s, hi_s, lo_m, hi_m = sc[..., :4], sc[..., 4:], m[..., :4], m[..., 4:]
    # ggml's 12 scale bytes: 0..3 scales 0..3 (top 2 bits: scales 4..7's high bits), 4..7 the same for the mins,
    # 8..11 scales 4..7's low 4 bits (low nibble) and mins 4..7's (high nibble)
    packed = torch.cat([lo_s | ((hi_s >> 4) << 6), lo_m | ((hi_m >> 4) << 6), (hi_s & 15) | ((hi_m & 15) << 4)], -1)
    # 128 bytes = 4 chunks of 32: low nibbles are group 2c, high nibbles group 2c + 1
    c = codes.to(torch.uint8).view(rows, -1, 4, 2, 32)
    qs = (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(rows, -1, 128)
    return torch.cat([_fp16_bytes(d), _fp16_bytes(dmin), packed, qs], -1).reshape(rows, -1).numpy()


def _q6_k_blocks(codes: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> np.ndarray:
    """Q6_K blocks (``w = d * sc_j * q`` per 16 of a super-block of 256) of codes ``[out, in]`` -32..31 with ``d``
    fp16 ``[out, in / 256]`` and ``sc`` int8 ``[out, in / 16]``: bytes ``[out, in / 256 * 210]``, the inverse of the
    loader's reading (``gguf_blocks.decode_int8``)."""
    rows = codes.shape[0]
    q = (codes.to(torch.int16) + 32).to(torch.uint8).view(rows, -1, 2, 128)  # [R, B, half, 128]
    # each half: 64 ql bytes (low nibbles weights 0..63, high 64..127), 32 qh bytes (bit pairs: weights 0..31,
    # 32..63, 64..95, 96..127)
    low = q & 15
    ql = (low[..., :64] | (low[..., 64:] << 4)).reshape(rows, -1, 128)
    high = (q >> 4).view(rows, -1, 2, 4, 32)
    qh = (high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6))
    scales = sc.to(torch.int8).contiguous().view(torch.uint8).view(rows, -1, 16)
    return torch.cat([ql, qh.reshape(rows, -1, 64), scales, _fp16_bytes(d)], -1).reshape(rows, -1).numpy()


def _k4_factors(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """Q4_K's two levels ``(d, dmin, sc, m)`` found exactly from an int4 layer's scales and zero points (a Q4_K
    file's layer on the reference layout), or None. The first row is tried before the whole weight (a layer not from
    a Q4_K file fails it at once)."""
    if codes.shape[1] % 256 or factor_k_scales(scales[:1], zeros[:1]) is None:
        return None
    return factor_k_scales(scales, zeros)


def _k6_parts(layer: Int8Linear, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Q6_K's two levels ``(d, sc)`` of an int8 layer in groups of 16 whose codes fit 6 bits: as held (a Q6_K file's
    blocks on the int8-activation layout), or found exactly from its scales (one block of rows first), or None."""
    if layer.group_size != 16 or codes.shape[1] % 256 or int(codes.min()) < -32 or int(codes.max()) > 31:
        return None
    held = getattr(layer, "wscale", None)
    if isinstance(held, torch.Tensor) and held.dtype == torch.uint8:
        return a8.unpack_k6_scales(held.cpu())
    scales = layer.weight_scale.float().cpu()
    if factor_k6_scales(scales[:a8.ROWS]) is None:
        return None
    got = factor_k6_scales(scales)
    return None if got is None else (got[0], got[1].to(torch.int8))


def _q8_scales(layer: Int8Linear) -> torch.Tensor | None:
    """An :class:`Int8Linear`'s scales as one per Q8_0 block ``[out, in // 32]`` (per-channel scales, or groups of a
    multiple of 32, repeat over the blocks they cover), or None where a block would need two (groups of 16)."""
    if layer.in_features % BLOCK:
        return None
    scale = layer.weight_scale.float()
    if layer.group_size is None:
        return scale.reshape(-1, 1).expand(-1, layer.in_features // BLOCK)
    if layer.group_size % BLOCK:
        return None
    return scale.repeat_interleave(layer.group_size // BLOCK, dim=1)


def _float_weight(module: nn.Module) -> torch.Tensor:
    """A layer's weight ``[out, in]`` in fp32: a float linear's, or a quantized layer's dequantized."""
    if type(module) is nn.Linear:
        return module.weight.detach().float()
    dequantize = getattr(module, "dequantize", None)
    if dequantize is None:
        raise CheckpointError(f"export_gguf: {type(module).__name__} has no dequantize(); infopt cannot write it")
    return dequantize().detach().float()


def _linear_tensor(module: nn.Module, kind: str, perm: torch.Tensor | None) -> tuple[np.ndarray, Any, str, str]:
    """``(data, raw_dtype, gguf_type, how)`` for one linear layer; ``how`` is ``exact``, ``rounded`` (codes kept,
    fp16 scales rounded), ``quantized`` (a float weight) or ``requantized`` (another quantized layer)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    if type(module) is Int4Linear and module.group_size == BLOCK and module.in_perm is None:
        if module.layout == "a8_k":  # a Q4_K file's blocks, held as they are (a dead group's codes too, which the
            # portable form zeroes)
            codes, k4 = a8.blocked_int4_codes(module.weight_packed.cpu()), a8.unpack_k_scales(module.scale_min.cpu())
        else:
            q, scales, zeros = module._portable()
            codes = unpack_int4(q).cpu()
            scales, zeros = scales.float().cpu(), zeros.float().cpu()
            order = (lambda t: t) if perm is None else (lambda t: t[perm])
            data, got, exact = _int4_blocks(order(codes), order(scales), order(zeros))
            k4 = None if exact or got == "Q4_0" else _k4_factors(codes, scales, zeros)
            if k4 is None:
                return data, getattr(Q, got), got, "exact" if exact else "rounded"
        # Q4_K: two levels of scales that Q4_1's fp16 fields would round, kept exactly (and in fewer bytes)
        if perm is not None:
            codes, k4 = codes[perm], tuple(t[perm] for t in k4)
        return _q4_k_blocks(codes, *k4), Q.Q4_K, "Q4_K", "exact"
    if type(module) is Int8Linear and module.group_size == 16:
        codes = module.codes().cpu()
        k6 = _k6_parts(module, codes)
        if k6 is not None:  # a Q6_K file's layer
            if perm is not None:
                codes, k6 = codes[perm], tuple(t[perm] for t in k6)
            return _q6_k_blocks(codes, *k6), Q.Q6_K, "Q6_K", "exact"
    scales = _q8_scales(module) if type(module) is Int8Linear else None
    if scales is not None:  # any layout: its codes read back exactly
        codes = module.codes()
        if perm is not None:
            codes, scales = codes[perm], scales[perm]
        data, exact = _int8_blocks(codes.cpu(), scales.cpu())
        return data, Q.Q8_0, "Q8_0", "exact" if exact else "rounded"
    how = "quantized" if type(module) is nn.Linear else "requantized"
    w = _float_weight(module).cpu()
    if perm is not None:
        w = w[perm]
    if kind in FLOAT_TYPES:
        data, raw = _numpy_float(w, kind)
        return data, raw, kind, "exact" if how == "quantized" and kind == "F32" else how
    if w.shape[1] % BLOCK:
        raise CheckpointError(f"export_gguf: a {kind} layer needs in_features divisible by {BLOCK}, got "
                              f"{tuple(w.shape)}; pass type='F16'")
    qtype = getattr(Q, kind)
    return quants.quantize(w.numpy(), qtype), qtype, kind, how


def _qk_order(rows: int, heads: int) -> torch.Tensor:
    """llama.cpp's row order of a Llama q/k projection: the inverse of the loader's gather (``gguf_ckpt._qk_perm``)."""
    from .gguf_ckpt import _qk_perm  # the GGUF reader, loaded with the writer's use

    return _qk_perm(rows, heads).argsort()


def _gguf_names(model: nn.Module, arch: str, num_layers: int) -> dict[str, str]:
    """``{module name: gguf tensor stem}`` for the modules holding weights, through gguf's ``TensorNameMap`` (the
    table the loaders read)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    table = get_tensor_name_map(arch_id, num_layers)
    out = {}
    for owner, module in model.named_modules():
        if not owner or next(module.children(), None) is not None:
            continue
        if (getattr(module, "weight", None) is None and not hasattr(module, "in_features")
                and not isinstance(module, (SharedInt8Embedding, BlockEmbedding))):
            continue
        parts = owner.split(".")
        for i in range(len(parts)):  # "model.layers.0.mlp.up_proj", then "layers.0.mlp.up_proj", ...
            name = table.get_name(".".join(parts[i:]))
            if name is not None:
                out[owner] = name
                break
    return out


def _check_gemma3(config) -> None:
    """What llama.cpp's Gemma 3 graph fixes instead of reading from the file, checked against the model: every sixth
    layer full attention and the rest sliding, the sliding layers' rotary base 10000 unscaled, attention scaled by
    ``1 / sqrt(head_dim)`` (``hidden / heads`` for its 62-layer size), no logit soft-capping, the tanh GELU.

    Raises:
        CheckpointError: naming the first setting llama.cpp would compute otherwise.
    """
    layers = config.num_hidden_layers
    pattern = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    scalar = gemma3_attention_scalar(layers, config.hidden_size, config.num_attention_heads, _head_dim(config))
    params = getattr(config, "rope_parameters", None) or {}
    local = params.get("sliding_attention", {}) if isinstance(params, dict) else {}
    wrong = [
        (list(getattr(config, "layer_types", None) or pattern) != pattern,
         "layer_types: llama.cpp makes every sixth layer full attention and the others sliding"),
        (not getattr(config, "sliding_window", None), "sliding_window: llama.cpp's Gemma 3 slides"),
        (float(getattr(config, "query_pre_attn_scalar", scalar)) != scalar,
         f"query_pre_attn_scalar {getattr(config, 'query_pre_attn_scalar', None)}: llama.cpp scales attention by "
         f"1/sqrt({scalar})"),
        (local.get("rope_type", "default") != "default" or float(local.get("rope_theta", 10000.0)) != 10000.0,
         f"the sliding layers' rotary parameters {local}: llama.cpp uses base 10000, unscaled"),
        (getattr(config, "attn_logit_softcapping", None) is not None, "attn_logit_softcapping: llama.cpp has none"),
        (getattr(config, "final_logit_softcapping", None) is not None,
         "final_logit_softcapping: llama.cpp builds differ in whether they read it"),
        (getattr(config, "hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh",
         f"hidden_activation {getattr(config, 'hidden_activation', None)!r}: llama.cpp's is the tanh GELU"),
        (bool(getattr(config, "use_bidirectional_attention", False)), "bidirectional attention"),
    ]
    for bad, what in wrong:
        if bad:
            raise CheckpointError(f"export_gguf: a Gemma 3 model's {what}, so the file would run another model there")


def _metadata(writer, config, arch: str, name: str, scaling: dict[str, Any]) -> None:
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    writer.add_name(name)
    rope = rope_parameters(config)
    keys: dict[str, int | float | str] = {}
    for gguf_key, hf_key in GGUF_TO_TRANSFORMERS_MAPPING["config"][arch].items():
        value = getattr(config, hf_key, None) if hf_key else None
        if hf_key == "rope_theta" and value is None:  # transformers 5 keeps it in rope_parameters
            value = rope.get("rope_theta")
        if value is not None and not isinstance(value, bool) and isinstance(value, (int, float)):
            keys[gguf_key] = value
    # llama.cpp takes a head's size as hidden / heads unless told: Qwen3's and Gemma 3's differ (and transformers'
    # qwen3 table does not write it); keys and values alike, and all of it rotated
    head_dim = _head_dim(config)
    keys["rope.dimension_count"] = head_dim
    if head_dim != config.hidden_size // config.num_attention_heads:
        keys["attention.key_length"] = keys["attention.value_length"] = head_dim
    keys.update(scaling)  # a rotary scaling's keys (export_rope)
    for key, value in keys.items():
        add = (writer.add_string if isinstance(value, str) else writer.add_uint32 if isinstance(value, int)
               else writer.add_float32)
        add(f"{arch}.{key}", value if isinstance(value, (int, str)) else float(value))


def _tokenizer(writer, tokenizer, vocab_size: int, pre: str) -> None:
    """A BPE (GPT-2 style) fast tokenizer's vocabulary, merges, special tokens and chat template."""
    from gguf import TokenType

    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = json.loads(backend.to_str()) if backend is not None else {}
    model = state.get("model", {})
    if model.get("type") != "BPE":
        raise CheckpointError(f"export_gguf: the tokenizer's model is {model.get('type')!r}; infopt writes BPE "
                              "(GPT-2 style) tokenizers only. Pass tokenizer=None to write the weights alone")
    vocab = tokenizer.get_vocab()
    by_id = {i: t for t, i in vocab.items()}
    if len(by_id) > vocab_size:
        raise CheckpointError(f"export_gguf: the tokenizer has {len(by_id)} tokens, the model's embedding "
                              f"{vocab_size} rows")
    special = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    added = {t.content for t in tokenizer.added_tokens_decoder.values()}
    tokens, types = [], []
    for i in range(vocab_size):
        tok = by_id.get(i)
        if tok is None:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        else:
            tokens.append(tok)
            types.append(TokenType.CONTROL if tok in special else TokenType.USER_DEFINED if tok in added
                         else TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for attr, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                      ("unk_token_id", writer.add_unk_token_id), ("pad_token_id", writer.add_pad_token_id)):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            add(value)
    writer.add_add_bos_token(bool(getattr(tokenizer, "add_bos_token", False)))
    if getattr(tokenizer, "chat_template", None):
        writer.add_chat_template(tokenizer.chat_template)


def export_gguf(model: nn.Module, path: str | os.PathLike, tokenizer=None, *, type: str = "Q4_0",
                float_type: str | None = None, pre: str = "default") -> dict[str, Any]:
    """Write ``model`` (a transformers causal LM, as it is: float, or with infopt's int4/int8 layers) as a GGUF
    file; see the module docstring for what each tensor becomes.

    Args:
        path: the ``.gguf`` file to write (its folder must exist).
        tokenizer: the model's tokenizer (a fast BPE one), written into the file; None writes no vocabulary
            (:func:`infopt.load_quantized` then loads it with ``tokenizer=False``; llama.cpp needs one).
        type: the GGUF type for float linears: one of :data:`EXPORT_TYPES`.
        float_type: the embeddings: one of :data:`FLOAT_TYPES`; default the model's own
            (``BF16`` for bf16 models, ``F32`` for fp32 ones, ``F16`` for fp16 ones: exact). An embedding that
            kept a GGUF file's blocks (:class:`~infopt.quantize.community.gguf_embedding.BlockEmbedding`) is
            written in them, as read.
        pre: llama.cpp's pre-tokenizer name (``tokenizer.ggml.pre``), e.g. ``"smollm"`` for SmolLM2; ``"default"``
            leaves llama.cpp its generic one (token ids given to it decode the same either way).

    Returns:
        A report: ``path``, ``bytes``, ``tensors``, ``linears`` (GGUF type -> count), and ``exact``, ``rounded``,
        ``quantized``, ``requantized`` (the linears of each kind; see the module docstring).

    Raises:
        CheckpointError: an architecture other than :data:`ARCHS`, a scaled rotary embedding or (Gemma 3) another
            setting llama.cpp would not compute as the model does, a type outside
            :data:`EXPORT_TYPES`, a layer infopt cannot write, a tokenizer that is not BPE.
        MissingBackendError: the ``gguf`` package is not installed (``pip install 'infopt[gguf]'``).

    Example:
        >>> import infopt
        >>> model, tok = infopt.load_default()  # doctest: +SKIP
        >>> infopt.export_gguf(model, "smollm2-q4_0.gguf", tok, type="Q4_0", pre="smollm")["linears"]  # doctest: +SKIP
        {'Q4_0': 210}
    """
    require("gguf", feature="export_gguf")
    import gguf

    if type not in EXPORT_TYPES:
        raise CheckpointError(f"export_gguf: type {type!r}; allowed: {', '.join(EXPORT_TYPES)}")
    config = model.config
    arch = ARCHS.get(getattr(config, "model_type", None))
    if arch is None:
        raise CheckpointError(f"export_gguf: architecture {getattr(config, 'model_type', None)!r}; infopt writes "
                              f"{', '.join(ARCHS)}")
    dtype = next(model.parameters()).dtype
    float_type = float_type or {torch.bfloat16: "BF16", torch.float16: "F16"}.get(dtype, "F32")
    if float_type not in FLOAT_TYPES:
        raise CheckpointError(f"export_gguf: float_type {float_type!r}; allowed: {', '.join(FLOAT_TYPES)}")
    rope_scaling, rope_divisors = export_rope(config, arch)  # a scaling llama.cpp cannot compute: refused here
    if arch == "gemma3":
        _check_gemma3(config)
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    shared = isinstance(embed, SharedInt8Embedding)  # cpu-fast's: the embedding reads the int8 head's rows
    tied = (head is not None and getattr(head, "weight", None) is not None
            and head.weight is getattr(embed, "weight", None)) or (shared and head is embed.head)
    rows = embed.num_embeddings
    # each tensor goes to a spooled temporary file as it is made (at most 256 MB of them in memory), not into a list
    # holding the whole model: an 8B model's export needs one layer's arrays at a time
    writer = gguf.GGUFWriter(str(path), arch, use_temp_file=True)
    _metadata(writer, config, arch, str(getattr(config, "name_or_path", "") or "infopt"), rope_scaling)
    if getattr(config, "vocab_size", None) != rows:
        writer.add_vocab_size(rows)
    if tokenizer is not None:
        _tokenizer(writer, tokenizer, rows, pre)
    report: dict[str, Any] = {"path": str(path), "type": type, "float_type": float_type, "linears": {},
                              "exact": [], "rounded": [], "quantized": [], "requantized": [], "tensors": 0}
    if rope_divisors is not None:  # llama3's rotary scaling: one divisor per frequency, as llama.cpp reads it
        writer.add_tensor(FREQS_TENSOR, rope_divisors)
        report["tensors"] += 1
    for owner, stem in _gguf_names(model, arch, config.num_hidden_layers).items():
        module = model.get_submodule(owner)
        if tied and module is head:
            continue  # llama.cpp reads a missing output.weight as the embedding
        role = stem.rsplit(".", 1)[-1]
        perm = _qk_order(module.out_features, heads[role]) if arch == "llama" and role in heads else None
        if module is embed and isinstance(module, BlockEmbedding):  # a GGUF file's blocks: written as they are
            data, raw = module.blocks.cpu().numpy(), gguf.GGMLQuantizationType[module.kind]
        elif module is embed and not shared:
            data, raw = _numpy_float(module.weight, float_type)
        elif hasattr(module, "in_features") or module is embed:  # a linear layer, float or quantized, or a shared
            # embedding: the int8 head's codes, which llama.cpp also reads as the output layer
            layer, kind = (module.head, "Q8_0") if module is embed else (module, type)
            data, raw, got, how = _linear_tensor(layer, kind, perm)
            report["linears"][got] = report["linears"].get(got, 0) + 1
            report[how].append(owner)
        else:  # a norm (Gemma's scale by 1 + w, llama.cpp's by the stored weight)
            data, raw = _numpy_float(module.weight.float() + 1 if arch == "gemma3" else module.weight, "F32")
        writer.add_tensor(f"{stem}.weight", data, raw_dtype=raw)
        report["tensors"] += 1
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor):
            data, raw = _numpy_float(bias if perm is None else bias[perm], "F32")
            writer.add_tensor(f"{stem}.bias", data, raw_dtype=raw)
            report["tensors"] += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    report["bytes"] = Path(path).stat().st_size
    log.info("export_gguf: %s, %d tensors, linears %s", path, report["tensors"], report["linears"])
    return report
