"""Export int4 layers in the GPTQ checkpoint layout that transformers, gptqmodel and vLLM load, and read it back.

The layout (``checkpoint_format: gptq``, 4 bits), per linear ``<fqn>``:

- ``<fqn>.qweight`` int32 ``[in / 8, out]``: eight 4-bit codes per word along the input dimension,
  input channel ``i`` in bits ``4 * (i % 8)``.
- ``<fqn>.qzeros`` int32 ``[groups, out / 8]``: zero points packed the same way along the output
  dimension, stored minus one (the format's historical convention).
- ``<fqn>.scales`` fp16 ``[groups, out]``.
- ``<fqn>.g_idx`` int32 ``[in]``: the group of each input channel (not monotone with act-order).
- ``<fqn>.bias`` fp16 ``[out]`` when the layer has one.

A weight is ``(code - zero) * scale`` with the group given by ``g_idx``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ...core.errors import IncompatibleModelError
from ..formats.int4 import Int4Linear
from ..formats.int8 import Int8Linear
from ..formats.primitives import unpack_int4

__all__ = ["export_gptq", "gptq_tensors", "dequantize_gptq", "load_gptq_state", "unpack_words"]


def _pack_rows(codes: torch.Tensor) -> torch.Tensor:
    # codes: [R, C] ints 0..15, R % 8 == 0 -> int32 [R / 8, C], row r in bits 4 * (r % 8)
    r, c = codes.shape
    c8 = codes.to(torch.int64).reshape(r // 8, 8, c)
    shifts = (torch.arange(8, dtype=torch.int64) * 4).view(1, 8, 1)
    words = (c8 << shifts).sum(dim=1)  # [R/8, C] in 0..2^32-1
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)


def gptq_tensors(layer: Int4Linear) -> dict[str, torch.Tensor]:
    """One :class:`Int4Linear` in the GPTQ layout (see the module docstring).

    Raises:
        IncompatibleModelError: fractional zero points (``Int4WeightOnly(zero_point="float")``), which
            the format cannot hold, or sizes not divisible by 8.
    """
    q, scales, zeros = layer._portable()
    codes = unpack_int4(q)  # [out, in] in stored column order
    out_f, in_f = codes.shape
    if out_f % 8 or in_f % 8:
        raise IncompatibleModelError(f"GPTQ export needs in/out features divisible by 8; got {in_f}x{out_f}")
    zr = zeros.round()
    # kernel layouts keep (8 - zero) * scale in bf16 (8 significant bits): integer zero points come back within 8 * 2^-8
    if (zeros - zr).abs().max() > 0.04 or zr.min() < 0 or zr.max() > 15:
        raise IncompatibleModelError(
            "this layer has fractional zero points (Int4WeightOnly(zero_point='float')), which the GPTQ layout "
            "cannot store; quantize with zero_point='int', GPTQ or AWQ to export"
        )
    g = layer.group_size
    stored_group = torch.arange(in_f) // g  # group of each stored column
    if layer.in_perm is not None:  # stored column j is input channel in_perm[j]
        perm = layer.in_perm.cpu()
        orig = torch.empty_like(codes)
        orig[:, perm] = codes
        g_idx = torch.empty(in_f, dtype=torch.int64)
        g_idx[perm] = stored_group
        codes = orig
    else:
        g_idx = stored_group
    out = {
        "qweight": _pack_rows(codes.t().contiguous()),  # [in/8, out]
        "qzeros": _pack_cols(zr.to(torch.int64).t() - 1),  # [G, out/8], stored minus one
        "scales": scales.t().contiguous().to(torch.float16),  # [G, out]
        "g_idx": g_idx.to(torch.int32),
    }
    if layer.bias is not None:
        out["bias"] = layer.bias.detach().to(torch.float16)
    return out


def unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unpack int32 words holding ``32 // bits`` codes each, lowest bits first, along ``dim`` (0 or 1).

    ``[R, C]`` words -> ``[R * k, C]`` (dim 0) or ``[R, C * k]`` (dim 1) uint8 codes, ``k = 32 // bits``.

    Example:
        >>> unpack_words(torch.tensor([[0x00000021]], dtype=torch.int32), 4, 1)[0, :3].tolist()
        [1, 2, 0]
    """
    k = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    mask = (1 << bits) - 1
    w = words.to(torch.int32)
    if dim == 0:
        codes = (w.unsqueeze(1) >> shifts.view(1, k, 1)) & mask  # [R, k, C]
        return codes.reshape(-1, words.shape[1]).to(torch.uint8)
    codes = (w.unsqueeze(2) >> shifts.view(1, 1, k)) & mask  # [R, C, k]
    return codes.reshape(words.shape[0], -1).to(torch.uint8)


def _pack_cols(x: torch.Tensor) -> torch.Tensor:
    # x: [G, out] ints (may be -1 for a zero point of 0) -> int32 [G, out / 8], column c in bits 4 * (c % 8)
    return _pack_rows((x & 0xF).t().contiguous()).t().contiguous()


def dequantize_gptq(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The fp32 weight ``[out, in]`` a GPTQ-layout tensor set stands for (the format's own arithmetic)."""
    codes = unpack_words(t["qweight"], 4, 0).float()  # [in, out]
    zeros = ((unpack_words(t["qzeros"], 4, 1) + 1) & 0xF).float()  # [G, out]
    g_idx = t["g_idx"].long()
    scales = t["scales"].float()
    return ((codes - zeros[g_idx]) * scales[g_idx]).t().contiguous()


def export_gptq(model: nn.Module, directory: str | Path, tokenizer=None) -> Path:
    """Write ``model`` (its :class:`Int4Linear` layers in the GPTQ layout, everything else as is) to ``directory``.

    The folder gets ``model.safetensors``, ``config.json`` with a ``quantization_config``
    (``quant_method: gptq``), ``quantize_config.json``, and the tokenizer when given.

    Raises:
        IncompatibleModelError: no int4 layer, mixed group sizes, or a layer the format cannot hold.

    Example:
        >>> import tempfile, infopt
        >>> from infopt.models import tiny_model
        >>> from infopt.quantize import Int4WeightOnly
        >>> m = infopt.optimize(tiny_model(), [Int4WeightOnly(group_size=32, zero_point="int")])
        >>> (export_gptq(m, tempfile.mkdtemp()) / "quantize_config.json").is_file()
        True
    """
    layers = {n: mod for n, mod in model.named_modules() if isinstance(mod, Int4Linear)}
    if not layers:
        raise IncompatibleModelError("export_gptq found no Int4Linear layer; quantize with int4, gptq or awq first")
    other = [n for n, mod in model.named_modules() if isinstance(mod, Int8Linear)]
    if other:
        raise IncompatibleModelError(
            f"export_gptq writes int4 layers only; {other[0]} is an Int8Linear (e.g. a head quantized by "
            "include_lm_head=True), which GPTQ loaders would not read. Quantize without include_lm_head to export"
        )
    groups = {mod.group_size for mod in layers.values()}
    if len(groups) != 1:
        raise IncompatibleModelError(f"export_gptq needs one group size for all layers; found {sorted(groups)}")
    desc_act = any(mod.in_perm is not None for mod in layers.values())
    state: dict[str, torch.Tensor] = {}
    for name, mod in layers.items():
        for k, v in gptq_tensors(mod).items():
            state[f"{name}.{k}"] = v.contiguous()
    seen = set()
    for k, v in model.state_dict().items():
        owner = k.rsplit(".", 1)[0]
        if owner in layers:
            continue
        if v.data_ptr() in seen and "lm_head" in k:
            continue  # tied head: the config's tie_word_embeddings restores it
        seen.add(v.data_ptr())
        state[k] = v.detach().contiguous()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    qcfg = {"quant_method": "gptq", "bits": 4, "group_size": groups.pop(), "desc_act": desc_act, "sym": False,
            "checkpoint_format": "gptq", "true_sequential": True, "damp_percent": 0.01,
            "modules_in_block_to_quantize": None}
    config = model.config.to_dict()
    config["quantization_config"] = qcfg
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    (out / "quantize_config.json").write_text(json.dumps(qcfg, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def load_gptq_state(directory: str | Path) -> dict[str, torch.Tensor]:
    """Read a GPTQ-layout checkpoint written by :func:`export_gptq` (or another tool) into a dense fp32 state dict:
    every ``<fqn>.qweight`` group becomes ``<fqn>.weight``. For checking an export without a GPTQ backend."""
    raw = load_file(str(Path(directory) / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    prefixes = {k[: -len(".qweight")] for k in raw if k.endswith(".qweight")}
    for p in prefixes:
        t = {s: raw[f"{p}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx")}
        out[f"{p}.weight"] = dequantize_gptq(t)
        if f"{p}.bias" in raw:
            out[f"{p}.bias"] = raw[f"{p}.bias"].float()
    for k, v in raw.items():
        if k.rsplit(".", 1)[0] not in prefixes:
            out[k] = v
    return out
