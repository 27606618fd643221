"""GPTQ and AWQ (GEMM) checkpoint folders, read with safetensors onto :class:`Int4Linear` / :class:`Int8Linear`.

GPTQ (AutoGPTQ, GPTQModel, optimum; ``quant_method: gptq``), per quantized linear ``<fqn>``:

- ``qweight`` int32 ``[in * bits / 32, out]``: ``32 / bits`` codes per word along the input dimension, lowest
  bits first;
- ``qzeros`` int32 ``[groups, out * bits / 32]``: zero points packed the same way along the output dimension;
  ``checkpoint_format: gptq`` (v1, the default and what most files on the Hub are) stores them minus one,
  ``gptq_v2`` as they are;
- ``scales`` fp16 ``[groups, out]``; ``g_idx`` int32 ``[in]``, the group of each input channel (absent in some
  old files: ``i // group_size``; not monotone with act-order, ``desc_act: true``); ``bias`` optional.

A weight is ``(code - zero) * scale`` with the group ``g_idx`` gives. 4 bits become an :class:`Int4Linear`:
with act-order the input channels are sorted by group (``in_perm``, so every group is contiguous, which the
kernels need); ``group_size: -1`` or groups larger than 256 are split into kernel-sized groups with the same
scale (exact). 8 bits become an :class:`Int8Linear` when every ``code - zero`` fits in int8 (always so for
``sym: true``, zero 128), per channel with ``group_size: -1`` (the fused int8 kernel) or per group (dequantized
per call); act-order with groups has no 8-bit layout (refused).

AWQ GEMM (AutoAWQ ``version: gemm``; ``quant_method: awq``), per linear: ``qweight`` int32 ``[in, out / 8]``
and ``qzeros`` int32 ``[groups, out / 8]`` with eight 4-bit values per word in AWQ's interleaved order (word
nibble ``i`` holds column ``[0, 2, 4, 6, 1, 3, 5, 7][i]`` of its eight), zero points as they are, ``scales``
fp16 ``[groups, out]``. Other AWQ versions (GEMV, GEMV-fast, Marlin) pack differently and are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from ...core.errors import CheckpointError
from .common import LoadOptions, check_shape, int4_layer, int8_layer, read_json, unpack_words

__all__ = ["GPTQFormat", "AWQFormat", "read_quant_config", "SafetensorsFolder", "gptq_layer", "awq_layer",
           "AWQ_ORDER"]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Which of its eight output columns each nibble of an AWQ word holds (nibble ``i``: column ``AWQ_ORDER[i]``)."""


@dataclass(frozen=True)
class GPTQFormat:
    """The fields of a GPTQ ``quantization_config`` that decide how its tensors are read."""

    bits: int
    group_size: int  # -1: one group per row
    desc_act: bool
    sym: bool
    zeros_minus_one: bool  # checkpoint_format gptq (v1)

    @classmethod
    def from_dict(cls, q: dict[str, Any], source: str) -> GPTQFormat:
        bits = q.get("bits", q.get("w_bit"))
        if bits not in (4, 8):
            raise CheckpointError(f"{source}: GPTQ with bits={bits!r}; infopt loads 4-bit (Int4Linear) and 8-bit "
                                  "(Int8Linear) GPTQ. 2- and 3-bit codes have no infopt layer")
        fmt = str(q.get("checkpoint_format") or q.get("format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise CheckpointError(f"{source}: GPTQ checkpoint_format {fmt!r}; infopt reads 'gptq' (v1, zero points "
                                  "stored minus one) and 'gptq_v2'. Marlin/BitBLAS/other repacked formats are laid "
                                  "out for their kernels: re-save the model in the gptq format with GPTQModel")
        gs = q.get("group_size", -1)
        if not isinstance(gs, int) or isinstance(gs, bool) or not (gs == -1 or gs > 0):
            raise CheckpointError(f"{source}: group_size={gs!r}; expected -1 or a positive integer")
        return cls(bits=bits, group_size=gs, desc_act=bool(q.get("desc_act", False)), sym=bool(q.get("sym", True)),
                   zeros_minus_one=fmt == "gptq")


@dataclass(frozen=True)
class AWQFormat:
    """The fields of an AWQ ``quantization_config`` (or AutoAWQ ``quant_config.json``) that matter here."""

    group_size: int

    @classmethod
    def from_dict(cls, q: dict[str, Any], source: str) -> AWQFormat:
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise CheckpointError(f"{source}: AWQ version {version!r}; infopt reads the GEMM packing (version "
                                  "'gemm'), the one AutoAWQ writes by default. GEMV/GEMV-fast/Marlin files pack "
                                  "their codes for their own kernels")
        bits = q.get("bits", q.get("w_bit", 4))
        if bits != 4:
            raise CheckpointError(f"{source}: AWQ with bits={bits!r}; only 4-bit AWQ exists in the GEMM layout")
        if not q.get("zero_point", True):
            raise CheckpointError(f"{source}: AWQ with zero_point=false has no GEMM layout infopt knows")
        gs = q.get("group_size", q.get("q_group_size", 128))
        if not isinstance(gs, int) or isinstance(gs, bool) or not (gs == -1 or gs > 0):
            raise CheckpointError(f"{source}: AWQ group_size={gs!r}; expected -1 or a positive integer")
        return cls(group_size=gs)


def read_quant_config(folder: Path) -> dict[str, Any] | None:
    """The checkpoint's quantization config: ``config.json``'s ``quantization_config``, else ``quantize_config.json``
    (AutoGPTQ) or ``quant_config.json`` (AutoAWQ) beside it; None when there is none."""
    cfg = folder / "config.json"
    if cfg.is_file():
        q = read_json(cfg).get("quantization_config")
        if isinstance(q, dict):
            return q
    for name, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
        if (folder / name).is_file():
            q = read_json(folder / name)
            q.setdefault("quant_method", method)
            return q
    return None


class SafetensorsFolder:
    """The tensors of ``model.safetensors`` or of the shards a ``model.safetensors.index.json`` lists, opened lazily."""

    def __init__(self, folder: Path):
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json(index).get("weight_map", {})
            files = sorted(set(weight_map.values()))
        elif (folder / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json; infopt reads "
                                  "GPTQ/AWQ checkpoints saved as safetensors")
        self._handles = {}
        self.where: dict[str, Any] = {}
        for f in files:
            if not (folder / f).is_file():
                raise CheckpointError(f"{folder}: shard {f} listed in the index is missing")
            h = safe_open(str(folder / f), framework="pt")
            self._handles[f] = h
            for k in h.keys():
                self.where[k] = h

    def keys(self) -> list[str]:
        return list(self.where)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise CheckpointError(f"tensor {name} is missing from the checkpoint")
        return self.where[name].get_tensor(name)

    def quantized_prefixes(self) -> list[str]:
        """Module names with a ``qweight`` tensor."""
        return sorted(k[: -len(".qweight")] for k in self.where if k.endswith(".qweight"))


def _groups(fmt_group: int, in_f: int, prefix: str) -> tuple[int, int]:
    gs = in_f if fmt_group == -1 else fmt_group
    if in_f % gs:
        raise CheckpointError(f"{prefix}: group_size {gs} does not divide its {in_f} input features")
    return gs, in_f // gs


def _bias(tensors: SafetensorsFolder, prefix: str, out_f: int) -> torch.Tensor | None:
    if f"{prefix}.bias" not in tensors:
        return None
    b = tensors.get(f"{prefix}.bias")
    check_shape(f"{prefix}.bias", b, (out_f,))
    return b.float()


def gptq_layer(tensors: SafetensorsFolder, prefix: str, fmt: GPTQFormat, in_f: int, out_f: int,
               opts: LoadOptions) -> nn.Module:
    """Build the infopt layer for the GPTQ linear ``prefix`` (``in_f`` x ``out_f`` in the model's config)."""
    bits = fmt.bits
    per = 32 // bits
    gs, n_groups = _groups(fmt.group_size, in_f, prefix)
    qweight = tensors.get(f"{prefix}.qweight")
    qzeros = tensors.get(f"{prefix}.qzeros")
    scales = tensors.get(f"{prefix}.scales")
    if in_f % per or out_f % per:
        raise CheckpointError(f"{prefix}: {in_f}x{out_f} is not a multiple of {per}, which {bits}-bit GPTQ packs by")
    check_shape(f"{prefix}.qweight", qweight, (in_f // per, out_f), torch.int32)
    check_shape(f"{prefix}.qzeros", qzeros, (n_groups, out_f // per), torch.int32)
    check_shape(f"{prefix}.scales", scales, (n_groups, out_f))
    if f"{prefix}.g_idx" in tensors:
        g_idx = tensors.get(f"{prefix}.g_idx").long()
        check_shape(f"{prefix}.g_idx", g_idx, (in_f,))
        if g_idx.min() < 0 or g_idx.max() >= n_groups:
            raise CheckpointError(f"{prefix}.g_idx: groups outside 0..{n_groups - 1}")
    else:
        g_idx = torch.arange(in_f) // gs
    codes = unpack_words(qweight, bits, 0).t()  # [out, in], input-channel order
    zeros = unpack_words(qzeros, bits, 1).t().to(torch.int32)  # [out, G]
    if fmt.zeros_minus_one:
        zeros = (zeros + 1) & ((1 << bits) - 1)
    scale = scales.t().float()  # [out, G]
    bias = _bias(tensors, prefix, out_f)
    trivial = bool(torch.equal(g_idx, torch.arange(in_f) // gs))
    in_perm = None
    if not trivial and n_groups > 1:
        # act-order: sort input channels by group so each group is contiguous (stable: the order inside a group
        # does not matter to the math, and stable keeps it reproducible)
        in_perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[in_perm], torch.arange(in_f) // gs):
            raise CheckpointError(f"{prefix}.g_idx: groups of unequal sizes (each should hold {gs} channels); "
                                  "not a GPTQ layout infopt can rebuild")
        codes = codes[:, in_perm]
    if bits == 4:
        return int4_layer(codes, scale, zeros.float(), gs, opts, bias=bias, in_perm=in_perm)
    if in_perm is not None:
        raise CheckpointError(f"{prefix}: 8-bit GPTQ with act-order groups (desc_act without static groups): "
                              "Int8Linear has no input permutation. Quantize with static_groups=True or "
                              "group_size=-1, or use 4 bits")
    q = codes.to(torch.int32) - zeros.repeat_interleave(gs, dim=1)  # [out, in]
    if q.min() < -128 or q.max() > 127:
        raise CheckpointError(f"{prefix}: 8-bit GPTQ codes minus zero points span {int(q.min())}..{int(q.max())}, "
                              "beyond int8; asymmetric 8-bit layers with such zero points have no Int8Linear layout")
    return int8_layer(q.to(torch.int8), scale[:, 0] if n_groups == 1 else scale, opts, bias=bias)


def _unpack_awq(words: torch.Tensor) -> torch.Tensor:
    # words: int32 [R, C / 8] -> uint8 [R, C] in column order (nibble i holds column AWQ_ORDER[i] of its eight)
    nib = unpack_words(words, 4, 1).view(words.shape[0], -1, 8)  # [R, C/8, nibble]
    cols = torch.empty_like(nib)
    cols[..., list(AWQ_ORDER)] = nib
    return cols.reshape(words.shape[0], -1)


def awq_layer(tensors: SafetensorsFolder, prefix: str, fmt: AWQFormat, in_f: int, out_f: int,
              opts: LoadOptions) -> nn.Module:
    """Build the :class:`Int4Linear` for the AWQ GEMM linear ``prefix``."""
    gs, n_groups = _groups(fmt.group_size, in_f, prefix)
    if out_f % 8:
        raise CheckpointError(f"{prefix}: {out_f} output features is not a multiple of 8, which AWQ packs by")
    qweight = tensors.get(f"{prefix}.qweight")
    qzeros = tensors.get(f"{prefix}.qzeros")
    scales = tensors.get(f"{prefix}.scales")
    check_shape(f"{prefix}.qweight", qweight, (in_f, out_f // 8), torch.int32)
    check_shape(f"{prefix}.qzeros", qzeros, (n_groups, out_f // 8), torch.int32)
    check_shape(f"{prefix}.scales", scales, (n_groups, out_f))
    codes = _unpack_awq(qweight).t()  # [out, in]
    zeros = _unpack_awq(qzeros).t().float()  # [out, G]
    return int4_layer(codes, scales.t().float(), zeros, gs, opts, bias=_bias(tensors, prefix, out_f))
