"""GGUF (llama.cpp) quantized blocks read into infopt's layer formats without a dequantized copy.

Each function takes the raw bytes of a ``[rows, in]`` tensor as uint8 ``[rows, in / block * block_bytes]``
(what ``gguf.GGUFReader`` maps) and returns codes with their group scales (and zero points):

=========  ====================================================  =========================================
type       ggml's formula, per block                              infopt layout
=========  ====================================================  =========================================
Q4_0       32 weights: ``d * (q - 8)``, q 4-bit, d fp16            int4 group 32: scale d, zero 8
Q4_1       32 weights: ``d * q + m``, d and m fp16                 int4 group 32: scale d, zero ``-m / d``
Q8_0       32 weights: ``d * q``, q int8                           int8 group 32: scale d
Q4_K       256 = 8 x 32: ``d * sc_j * q - dmin * m_j``, 6-bit      int4 group 32: scale ``d * sc_j``, zero
           ``sc_j``/``m_j``, d and dmin fp16                      ``dmin * m_j / (d * sc_j)``
Q6_K       256 = 16 x 16: ``d * sc_j * (q - 32)``, q 6-bit,        int8 group 16: codes ``q - 32``, scale
           ``sc_j`` int8                                           ``d * sc_j``
=========  ====================================================  =========================================

A group whose scale is zero holds one value, 0 (Q4_0), ``m`` (Q4_1) or ``-dmin * m_j`` (Q4_K), whatever its codes: it
gets codes 0, scale ``|value| / 8`` and zero ``-8 * sign(value)`` (or scale 1, zero 0 when the value is 0), so
the int4 layout, which needs a scale to recover its zero point, keeps it.

The decoded codes are the file's and the scales and zero points give its weights in fp32 up to float rounding (the
zero point is a quotient). A kernel layout that holds bf16 scales rounds them (Q4_0's, Q4_1's and Q4_K's on the
float-activation kernels); the int8-activation layouts keep them as the file does: Q4_0's fp16 scales (``a8_sym``,
:func:`a8_int4`), Q4_K's two levels (``a8_k``, :func:`a8_k_int4`), Q6_K's two levels (:func:`q6_k_parts`).

Byte layouts follow ggml's ``block_q4_0``, ``block_q4_1``, ``block_q8_0``, ``block_q4_K`` and ``block_q6_K``
(``ggml-common.h``); the tests check every type against ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import torch

from ..formats import a8

__all__ = ["BLOCKS", "Int4Blocks", "Int8Blocks", "A8_INT4", "decode_int4", "decode_int8", "dequantize_blocks",
           "a8_int4", "a8_k_int4", "a8_int8", "A8_INT8", "q8_0_scales", "q6_k_scales", "q6_k_parts", "decode_q4_0"]

# ggml type name -> (weights per block, bytes per block)
BLOCKS: dict[str, tuple[int, int]] = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144),
                                      "Q6_K": (256, 210)}
Int4Blocks = ("Q4_0", "Q4_1", "Q4_K")
"""Types that become int4 group-32 layers."""
Int8Blocks = ("Q8_0", "Q6_K")
"""Types that become int8 layers (group 32 and 16)."""


def _half(raw: torch.Tensor, start: int) -> torch.Tensor:
    # raw: uint8 [R, B, bytes] -> fp32 [R, B] of the fp16 at byte `start` of each block
    return raw[..., start:start + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles_16(qs: torch.Tensor) -> torch.Tensor:
    # qs: uint8 [R, B, 16] -> uint8 [R, B, 32]: low nibbles are weights 0..15, high nibbles 16..31 (Q4_0/Q4_1);
    # bytes, not int32: the a8 layout packs bytes, and a layout that takes int32 converts once
    if torch.compiler.is_compiling():  # a BlockEmbedding's lookup: no out= into views in a graph; the same bytes
        return torch.cat([qs & 0x0F, qs >> 4], dim=-1)
    out = torch.empty(*qs.shape[:-1], 32, dtype=torch.uint8)
    torch.bitwise_and(qs, 0x0F, out=out[..., :16])
    torch.bitwise_right_shift(qs, 4, out=out[..., 16:])
    return out


def _blocks(raw: torch.Tensor, kind: str) -> torch.Tensor:
    n, nbytes = BLOCKS[kind][1], raw.shape[-1]
    if nbytes % n:
        raise ValueError(f"{kind}: a row of {nbytes} bytes is not a whole number of {n}-byte blocks")
    return raw.view(raw.shape[0], nbytes // n, n)


def _affine(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int):
    """``w = scale * code + offset`` per group -> ``(codes, scale, zero)`` with ``w = (code - zero) * scale``."""
    dead = scale == 0  # the group is `offset` whatever its codes
    # (compiled, as a BlockEmbedding's lookup is, always taken: the same values, and no branch on the data)
    if torch.compiler.is_compiling() or bool(dead.any()):
        codes = codes.view(*scale.shape, group).masked_fill(dead.unsqueeze(-1), 0).view(codes.shape)
        value = torch.where(offset == 0, torch.ones_like(offset), offset.abs() / 8.0)
        scale = torch.where(dead, value, scale)
        offset = torch.where(dead & (offset == 0), torch.zeros_like(offset), offset)
    return codes, scale, -offset / scale


def decode_q4_0(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 bytes -> ``(codes uint8 [R, in], scales fp32 [R, in / 32])`` with ``w = (code - 8) * scale``: the blocks'
    fp16 scales as they are (zero, negative zero and subnormal ones included; a zero scale's codes set to 0), what
    the ``a8_sym`` layout holds and the transcoder writes.

    Example:
        >>> import numpy as np
        >>> blk = np.concatenate([np.array([0.5], np.float16).view(np.uint8), np.full(16, 0x21, np.uint8)])
        >>> c, s = decode_q4_0(torch.from_numpy(blk).view(1, 18))
        >>> c[0, :2].tolist(), c[0, 16:18].tolist(), s.tolist()
        ([1, 1], [2, 2], [[0.5]])
    """
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, 18)
    d = _half(b, 0)
    codes = _nibbles_16(b[..., 2:18])  # [R, B, 32]
    codes = codes.masked_fill((d == 0).unsqueeze(-1), 0).reshape(rows, -1)
    return codes, d


def decode_int4(raw: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 / Q4_K bytes -> ``(codes, scales, zeros)``: uint8 ``[R, in]`` codes 0..15, fp32 ``[R, in / 32]``
    scales and zero points, with ``w = (code - zero) * scale`` (see the module table).

    Example:
        >>> import numpy as np
        >>> blk = np.concatenate([np.array([0.5], np.float16).view(np.uint8), np.full(16, 0x21, np.uint8)])
        >>> c, s, z = decode_int4(torch.from_numpy(blk).view(1, 18), "Q4_0")
        >>> c[0, :2].tolist(), c[0, 16:18].tolist(), s.tolist(), z.tolist()
        ([1, 1], [2, 2], [[0.5]], [[8.0]])
    """
    b = _blocks(raw, kind)
    rows = b.shape[0]
    if kind == "Q4_0":
        d = _half(b, 0)
        return _affine(_nibbles_16(b[..., 2:18]).reshape(rows, -1), d, -8.0 * d, 32)
    if kind == "Q4_1":
        codes = _nibbles_16(b[..., 4:20]).reshape(rows, -1)
        return _affine(codes, _half(b, 0), _half(b, 2), 32)
    if kind == "Q4_K":
        d, dmin = _half(b, 0).unsqueeze(-1), _half(b, 2).unsqueeze(-1)  # [R, B, 1]
        sc, mn = _k4_scales(b[..., 4:16])  # [R, B, 8] each
        # 128 bytes = 4 chunks of 32: low nibbles are sub-block 2c, high nibbles 2c + 1
        qs = b[..., 16:144].reshape(rows, -1, 4, 1, 32)
        codes = (qs >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 1, 2, 1)) & 0x0F
        scale = (d * sc).reshape(rows, -1)  # exact in fp32: fp16 x 6-bit
        offset = -(dmin * mn).reshape(rows, -1)
        return _affine(codes.reshape(rows, -1), scale, offset, 32)
    raise ValueError(f"decode_int4: {kind} is not an int4 block type ({', '.join(Int4Blocks)})")


def _k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # s: uint8 [R, B, 12] -> 6-bit scales and mins [R, B, 8] (ggml's get_scale_min_k4): bytes 0..3 hold the
    # low 6 bits of scales 0..3 (top 2 bits: scales 4..7's high bits), 4..7 the same for the mins, 8..11 the
    # low 4 bits of scales 4..7 (low nibble) and mins 4..7 (high nibble)
    s = s.to(torch.int32)
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc.float(), mn.float()


def decode_int8(raw: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Q8_0 / Q6_K bytes -> ``(codes, scales, group)``: int8 ``[R, in]``, fp32 ``[R, in / group]``, with
    ``w = code * scale`` (group 32 for Q8_0, 16 for Q6_K).

    Example:
        >>> import numpy as np
        >>> blk = np.concatenate([np.array([0.25], np.float16).view(np.uint8), np.arange(-16, 16, dtype=np.int8).view(np.uint8)])
        >>> c, s, g = decode_int8(torch.from_numpy(blk).view(1, 34), "Q8_0")
        >>> c[0, :3].tolist(), s.tolist(), g
        ([-16, -15, -14], [[0.25]], 32)
    """
    b = _blocks(raw, kind)
    rows = b.shape[0]
    if kind == "Q8_0":
        return b[..., 2:34].contiguous().view(torch.int8).reshape(rows, -1), _half(b, 0), 32
    if kind == "Q6_K":
        # per 256: ql [128] low 4 bits, qh [64] high 2 bits, 16 int8 sub-scales, d fp16. Each half of 128 weights
        # takes 64 ql bytes (low nibbles: weights 0..63, high nibbles 64..127) and 32 qh bytes (bit pairs 0,2,4,6:
        # weights 0..31, 32..63, 64..95, 96..127)
        ql = b[..., 0:128].reshape(rows, -1, 2, 1, 64)
        ql = (ql >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 1, 2, 1)) & 0x0F  # [R, B, half, nib, 64]
        qh = b[..., 128:192].reshape(rows, -1, 2, 1, 32)
        qh = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1)) & 0x03  # [R, B, half, 4, 32]
        q = ql.reshape(rows, -1, 2, 4, 32) | (qh << 4)
        codes = (q.to(torch.int16) - 32).to(torch.int8).reshape(rows, -1)
        return codes, q6_k_scales(raw), 16
    raise ValueError(f"decode_int8: {kind} is not an int8 block type ({', '.join(Int8Blocks)})")


A8_INT4 = {"Q4_0": 0, "Q4_1": 1, "Q4_K": 2}
"""Types the C++ transcoder writes straight into the a8 int4 layout (:func:`a8_int4`), with its kind numbers."""


def a8_int4(raw: torch.Tensor, kind: str, perm: torch.Tensor | None = None, *, symmetric: bool = False,
            two_level: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Q4_0 / Q4_1 / Q4_K bytes ``[R, in / weights per block * bytes]`` straight into the a8 int4 layout,
    ``(weight, scale_min)`` of :func:`infopt.quantize.formats.a8.pack_blocked_int4` (row ``i`` from the file's row
    ``perm[i]``), in one pass of the C++ kernel: bit for bit :func:`decode_int4` then ``pack_blocked_int4``, without their decoded copies. None
    where the C++ kernels are not built (the caller takes that path instead) or ``kind`` is another type.
    ``symmetric`` (Q4_0 only): the ``a8_sym`` layout instead, the blocks' fp16 scales as they are, ``[R/16, G, 16]``;
    ``two_level`` (Q4_K only): the ``a8_k`` layout, the blocks' two levels of scales as they are (:func:`a8_k_int4`).

    Example:
        >>> import numpy as np
        >>> from infopt.quantize.formats.a8 import pack_blocked_int4
        >>> blk = np.concatenate([np.array([0.5], np.float16).view(np.uint8), np.arange(16, dtype=np.uint8) * 17])
        >>> raw = torch.from_numpy(np.tile(blk, (16, 2)))  # 16 rows of two Q4_0 blocks
        >>> got = a8_int4(raw, "Q4_0")
        >>> got is None or all(torch.equal(a, b) for a, b in zip(got, pack_blocked_int4(*decode_int4(raw, "Q4_0"))))
        True
    """
    if kind not in A8_INT4 or not a8.available():
        return None
    if symmetric and kind != "Q4_0":
        raise ValueError(f"a8_int4: symmetric=True takes Q4_0 blocks only, got {kind}")
    if two_level and kind != "Q4_K":
        raise ValueError(f"a8_int4: two_level=True takes Q4_K blocks only, got {kind}")
    return torch.ops.infopt.int4_a8_from_ggml(raw.contiguous(), 3 if symmetric else 4 if two_level else A8_INT4[kind],
                                              perm)


def a8_k_int4(raw: torch.Tensor, perm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K bytes ``[R, in / 256 * 144]`` into the ``a8_k`` layout (:class:`~infopt.quantize.formats.int4_layouts.A8K`):
    ``(weight, scale_min)``, the codes as the a8 layout packs them and the blocks' two-level scales as they are
    (:func:`~infopt.quantize.formats.a8.pack_k_scales`), row ``i`` from the file's row ``perm[i]``: every weight
    exactly the file's. Through the C++ transcoder in one pass where it is built, else torch operations (the same
    bytes).

    Example:
        >>> import numpy as np
        >>> from gguf import GGMLQuantizationType, dequantize
        >>> rng = np.random.default_rng(0)
        >>> raw = rng.integers(0, 256, (16, 144), dtype=np.uint8)
        >>> raw[:, :4] = np.array([0.01, 0.002], np.float16).view(np.uint8)  # d, dmin
        >>> weight, sm = a8_k_int4(torch.from_numpy(raw))
        >>> codes, _, _ = a8.unpack_blocked_int4(weight, sm)
        >>> s = a8.scale_min_rows(sm).repeat_interleave(32, -1)  # [2, R, in]: the kernels' scale and minimum
        >>> bool(torch.equal(codes.float() * s[0] + s[1], torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K))))
        True
    """
    b = _blocks(raw, "Q4_K")
    rows = b.shape[0]
    packed = a8_int4(raw, "Q4_K", perm, two_level=True)  # the C++ transcoder, in one pass
    if packed is not None:
        return packed
    codes, _, _ = decode_int4(raw, "Q4_K")  # (torch operations: the codes, and the two levels read as they are)
    if perm is not None:
        codes = codes[perm]
    weight, _ = a8.pack_blocked_int4(codes, torch.ones(rows, 1), torch.zeros(rows, 1))
    d, dmin = _half(b, 0), _half(b, 2)  # [R, B]
    sc, mn = _k4_scales(b[..., 4:16])  # [R, B, 8]
    sc, mn = sc.reshape(rows, -1), mn.reshape(rows, -1)
    if perm is not None:
        d, dmin, sc, mn = d[perm], dmin[perm], sc[perm], mn[perm]
    return weight, a8.pack_k_scales(d, dmin, sc, mn)


A8_INT8 = {"Q8_0": 0, "Q6_K": 1}
"""Types the C++ transcoder writes straight into the a8 int8 layout (:func:`a8_int8`), with its kind numbers."""


def a8_int8(raw: torch.Tensor, perm: torch.Tensor | None = None, kind: str = "Q8_0") -> torch.Tensor | None:
    """Q8_0 bytes ``[R, in / 32 * 34]`` (or Q6_K, ``[R, in / 256 * 210]``) straight into the a8 int8 layout, the
    weight of :func:`infopt.quantize.formats.a8.pack_blocked_int8` (row ``i`` from the file's row ``perm[i]``): bit
    for bit :func:`decode_int8` then ``pack_blocked_int8``, in one pass of the C++ kernel. None where the C++ kernels
    are not built. The scales are the caller's (:func:`q8_0_scales`, :func:`q6_k_scales`: ``decode_int8``'s, without
    reading the codes)."""
    if not a8.available():
        return None
    return torch.ops.infopt.int8_a8_from_ggml(raw.contiguous(), perm, A8_INT8[kind])


def q8_0_scales(raw: torch.Tensor) -> torch.Tensor:
    """The fp32 scales ``[R, in / 32]`` of Q8_0 bytes, without reading their codes."""
    return _half(_blocks(raw, "Q8_0"), 0)


def q6_k_scales(raw: torch.Tensor, parts: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The fp32 scales ``[R, in / 16]`` of Q6_K bytes (``d * sc_j``, exact in fp32), without reading their codes;
    ``parts``: their :func:`q6_k_parts`, where the caller has them already."""
    d, sc = q6_k_parts(raw) if parts is None else parts
    return (sc.view(sc.shape[0], d.shape[1], 16).float() * d.float().unsqueeze(-1)).reshape(sc.shape)


def q6_k_parts(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two levels of Q6_K bytes' scales: ``d`` fp16 ``[R, in / 256]`` and ``sc`` int8 ``[R, in / 16]``."""
    b = _blocks(raw, "Q6_K")
    rows = b.shape[0]
    return b[..., 208:210].contiguous().view(torch.float16).reshape(rows, -1), \
        b[..., 192:208].contiguous().view(torch.int8).reshape(rows, -1)


def dequantize_blocks(raw: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """The ``[R, in]`` weights in ``dtype`` (for embeddings, which stay dense)."""
    if kind in Int4Blocks:
        codes, scale, zero = decode_int4(raw, kind)
        g = codes.view(codes.shape[0], scale.shape[1], -1).float()
        return ((g - zero.unsqueeze(-1)) * scale.unsqueeze(-1)).reshape(codes.shape).to(dtype)
    codes, scale, group = decode_int8(raw, kind)
    g = codes.view(codes.shape[0], -1, group).float()
    return (g * scale.unsqueeze(-1)).reshape(codes.shape).to(dtype)
