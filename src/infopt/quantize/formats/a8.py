"""Int4 and int8 weights times 8-bit dynamic activations: integer dot products for one to a few rows.

Each call quantizes its activations per row and per group of ``group`` input channels (symmetric: codes
-127..127, scale ``absmax / 127``), multiplies them with the weight codes in integers, exactly, and applies the
float scales once per group. On the CPU the C++ kernel ``torch.ops.infopt.int4_a8_linear`` /
``int8_a8_linear`` (``infopt/ops/csrc/quant_linear.cpp``: AVX512-VNNI, AVX2 or portable C++) does it on weights
in the block layout below, which reads each weight byte once per call and shares every activation load
between 16 output rows. Elsewhere, or where the kernel cannot be built, :func:`int4_a8_reference` and
:func:`int8_a8_reference` compute the same numbers with torch operations (they are the kernels' oracle).

Activation quantization is lossy on top of the weights' quantization: a separate choice
(``Int4WeightOnly(activations="int8")``) with its own quality figures.

Block layouts (``N`` output rows in blocks of 16, ``K`` inputs, ``G = K // group``):

- int4: ``weight`` uint8 ``[N/16, K/8, 64]``; the 64 bytes of chunk ``c`` hold, at bytes ``4r..4r+3`` of row
  ``r`` of the block, the codes of columns ``8c..8c+3`` (low nibbles) and ``8c+4..8c+7`` (high nibbles).
  ``scale_min`` bf16 ``[N/16, G, 2, 16]``: per group, 16 scales then 16 minimums; ``w = code * scale + min``. For
  symmetric codes (every GGUF Q4_0 block) fp16 scales ``[N/16, G, 16]`` alone (the ``a8_sym`` layout):
  ``w = (code - 8) * scale``, 4.5 bits a weight instead of 5 and a Q4_0 file's scales kept exactly. For a GGUF
  Q4_K file's blocks (group 32, the ``a8_k`` layout) uint8 ``[N/16, G/8, 320]`` (:func:`pack_k_scales`): per
  super-group of 8 groups the block's 16 fp16 ``d`` and 16 fp16 ``dmin``, then per group its 16 6-bit ``sc`` and 16
  ``m``; ``scale = d * sc`` and ``min = -dmin * m``, each exact in fp32 (the kernel computes them per block), so the
  file's weights are kept exactly in 4.625 bits a weight. fp32 ``[N/16, G, 2, 16]`` is taken too (exact scales).
- int8: ``weight`` uint8 ``[N/16, K/4, 64]``, the codes plus 128 (their sign bits flipped: the unsigned operand of
  the integer dot product, whose offset the activations' own sums undo); chunk ``c`` holds columns ``4c..4c+3`` of
  row ``r`` at bytes ``4r..4r+3``. ``scale`` fp32 ``[N]``, or
  blocked ``[N/16, Gw, 16]`` (:func:`block_scales`) for one scale per row and group of ``K // Gw`` inputs, a multiple
  of ``group`` (a GGUF file's Q8_0 and Q6_K blocks): each activation group's integer dot product is then scaled by
  its row's scale for that group, the block's 16 rows' scales one vector load. For a GGUF Q6_K file's blocks (scales
  per 16 inputs) uint8 ``[N/16, Gw/16, 288]`` instead (:func:`pack_k6_scales`): per super-group of 16 scale groups
  the block's 16 fp16 ``d``, then per group its 16 int8 ``sc``; ``scale = d * sc``, exact in fp32 (the kernel
  computes them per block): 0.56 bits a weight read per call instead of 2.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from ...ops import cpp
from ...ops.cpp import ROWS
from .primitives import dequantize, group_block

__all__ = ["ACTIVATIONS", "resolve", "available", "isa", "quantize_activations", "pack_blocked_int4", "pack_blocked_int4_sym",
           "pack_k_scales", "unpack_k_scales", "k_scale_min", "K_SUPER", "factor_two_level", "pack_k6_scales", "unpack_k6_scales", "k6_block_scales", "K6_SUPER", "scale_min_rows", "blocked_int4_codes", "unpack_blocked_int4", "pack_blocked_int8", "unpack_blocked_int8", "biased",
           "block_scales", "unblock_scales",
           "int4_a8_linear", "int4_a8_linear_n", "int8_a8_linear", "int4_a8_reference", "int8_a8_reference", "int4_dense_t",
           "dense_scratch",
           "int4_dense_t_reference", "int8_f32_linear", "ROWS", "KERNELS", "kernel_calls"]


KERNELS = ("int4_a8_linear", "int4_a8_linear_n", "int8_a8_linear", "int8_f32_linear", "int4_a8_dense_t", "reference")
"""Keys of :func:`kernel_calls`: each C++ operator ``torch.ops.infopt.<key>``, and ``reference`` (any of this module's
functions computing its torch reference instead: not on the CPU, another dtype, or the C++ kernels not built)."""

_CALLS = dict.fromkeys(KERNELS, 0)  # eager calls per kernel since import (a diagnostic: unlocked, += under the GIL)


def kernel_calls() -> dict[str, int]:
    """Eager calls of :func:`int4_a8_linear`, :func:`int4_a8_linear_n`, :func:`int8_a8_linear`,
    :func:`int8_f32_linear` and :func:`int4_dense_t` since import, per kernel that served them (:data:`KERNELS`).

    Calls traced into a compiled graph are not counted (the graph calls the operator itself, and a count read while
    tracing would make dynamo guard on it); :class:`~infopt.quantize.Int8Linear`, which calls the int8 x fp32 operator
    directly, counts in :func:`infopt.quantize.formats.int8.kernel_calls`. Take the difference of two snapshots.

    Example:
        >>> from infopt.quantize.formats.int4 import quantize_int4_grouped
        >>> weight, sm = pack_blocked_int4(*quantize_int4_grouped(torch.randn(32, 64), 32))
        >>> before = kernel_calls()
        >>> _ = int4_a8_linear(torch.randn(1, 64), weight, sm, 32)
        >>> ran = "int4_a8_linear" if available() else "reference"
        >>> kernel_calls()[ran] - before[ran]
        1
    """
    return dict(_CALLS)


def _count(kernel: str) -> None:
    if not torch.compiler.is_compiling():
        _CALLS[kernel] += 1

def available() -> bool:
    """Whether the C++ kernels are loaded (built on first call; see :mod:`infopt.ops.cpp`)."""
    return cpp.load("quant_linear")


def isa() -> str | None:
    """The instruction set the C++ kernels were built for (``"avx512_vnni"``, ``"avx2"``, ``"portable"``), or None
    when they are not available."""
    return torch.ops.infopt.quant_linear_isa() if available() else None


ACTIVATIONS = ("float", "int8", "auto")
"""The values of the quantize configs' ``activations`` field."""


def resolve(activations: str, device: torch.device | str = "cpu") -> str:
    """``"int8"`` or ``"float"`` for a config's ``activations`` on ``device``: ``"auto"`` is ``"int8"`` where the C++
    kernel runs with AVX512-VNNI or AVX2 (where it was measured faster than the float-activation kernels: on a 2-core
    AVX512-VNNI Xeon and on a 2-core AVX2 EPYC; ``benchmarks/int4_rows.py``), else ``"float"``.

    Example:
        >>> resolve("float"), resolve("auto", "cuda")
        ('float', 'float')
    """
    if activations != "auto":
        return activations
    return "int8" if torch.device(device).type == "cpu" and isa() in ("avx512_vnni", "avx2") else "float"


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row, per-group symmetric int8 codes of ``x`` ``[M, K]``: ``(codes int8 [M, K], scales fp32 [M, K/group])``
    with ``x ~= codes * scale``; the kernels' rounding exactly (``round(x * (127 / absmax))``, ties to even).

    Example:
        >>> q, s = quantize_activations(torch.tensor([[1.0, -2.0, 0.5, 0.0]]), 2)
        >>> q.tolist(), s.mul(127).tolist()
        ([[64, -127, 127, 0]], [[2.0, 0.5]])
    """
    m, k = x.shape
    xg = x.float().reshape(m, k // group, group)
    amax = xg.abs().amax(-1, keepdim=True)
    # correctly rounded divisions, as the kernels compute them (torch turns `127.0 / t` into `t.reciprocal() * 127`
    # and a division by a scalar into a multiplication by its reciprocal: 1 ulp off, enough to move a code at a tie)
    c127 = torch.full_like(amax, 127.0)
    inv = torch.where(amax > 0, c127.div(amax), torch.zeros_like(amax))
    q = torch.round(xg * inv).clamp_(-127, 127).to(torch.int8)
    return q.reshape(m, k), amax.div(c127).squeeze(-1)


def _check_rows(n: int) -> None:
    if n % ROWS:
        raise ValueError(f"the a8 block layout needs out_features divisible by {ROWS}, got {n}")


def pack_blocked_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Int4 codes ``[N, K]`` (0..15) with ``w = (code - zero) * scale`` per group into ``(weight, scale_min)`` (module
    docstring). Scales are rounded to bf16 first and the minimum ``-zero * scale`` computed from the rounded scale."""
    n, k = codes.shape
    _check_rows(n)
    groups = scales.shape[1]
    c = codes.to(torch.uint8).reshape(n // ROWS, ROWS, k // 8, 2, 4)  # [blk, r, chunk, half, j]
    packed = c[:, :, :, 0, :] | (c[:, :, :, 1, :] << 4)  # [blk, r, chunk, j]
    weight = packed.permute(0, 2, 1, 3).reshape(n // ROWS, k // 8, 4 * ROWS).contiguous()
    s16 = scales.float().to(torch.bfloat16)
    mn = (-zeros.float() * s16.float()).to(torch.bfloat16)
    scale_min = torch.stack([s16, mn], 0).reshape(2, n // ROWS, ROWS, groups).permute(1, 3, 0, 2).contiguous()
    return weight, scale_min


def pack_blocked_int4_sym(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int4 codes ``[N, K]`` (``w = (code - 8) * scale``) into ``(weight, scales fp16 [N/16, G, 16])``
    (module docstring); the scales are rounded to fp16."""
    n = codes.shape[0]
    weight, _ = pack_blocked_int4(codes, scales[:, :1], torch.zeros_like(scales[:, :1]))
    return weight, scales.float().to(torch.float16).reshape(n // ROWS, ROWS, -1).transpose(1, 2).contiguous()


K_SUPER = 8
"""Groups of 32 per super-block of a Q4_K scale (:func:`pack_k_scales`)."""


def pack_k_scales(d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Q4_K's two-level scales in the a8 blocks (module docstring): ``d``, ``dmin`` fp16 ``[N, G/8]`` and ``sc``,
    ``m`` ``[N, G]`` integers 0..63 -> uint8 ``[N/16, G/8, 320]``; ``w = code * (d * sc) - dmin * m`` per group.

    Example:
        >>> d, dmin = torch.full((16, 1), 0.5, dtype=torch.float16), torch.full((16, 1), 0.25, dtype=torch.float16)
        >>> sc, m = torch.arange(8).repeat(16, 1), torch.full((16, 8), 2)
        >>> sm = k_scale_min(pack_k_scales(d, dmin, sc, m))  # fp32 [N/16, G, 2, 16]
        >>> sm[0, 3, 0, 0].item(), sm[0, 3, 1, 0].item()
        (1.5, -0.5)
    """
    n, g = sc.shape
    _check_rows(n)
    if g % K_SUPER or tuple(d.shape) != (n, g // K_SUPER) or tuple(dmin.shape) != (n, g // K_SUPER):
        raise ValueError(f"pack_k_scales: sc/m [{n}, {g}] need d/dmin [{n}, {g // K_SUPER}] and groups in whole "
                         f"super-blocks of {K_SUPER}, got d {tuple(d.shape)}, dmin {tuple(dmin.shape)}")
    if int(sc.min()) < 0 or int(sc.max()) > 63 or int(m.min()) < 0 or int(m.max()) > 63:
        raise ValueError("pack_k_scales: sc and m must be integers 0..63 (Q4_K's 6-bit scales)")
    nb, s = n // ROWS, g // K_SUPER
    head = torch.stack([d.to(torch.float16), dmin.to(torch.float16)], 0)  # [2, N, S]
    head = head.reshape(2, nb, ROWS, s).permute(1, 3, 0, 2).contiguous().view(torch.uint8)  # [nb, S, 2, 32 bytes]
    body = torch.stack([sc, m], 0).to(torch.uint8).reshape(2, nb, ROWS, s, K_SUPER)
    body = body.permute(1, 3, 4, 0, 2).contiguous()  # [nb, S, 8, 2, 16]
    return torch.cat([head.reshape(nb, s, 64), body.reshape(nb, s, 256)], -1).contiguous()


def unpack_k_scales(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_k_scales`: uint8 ``[N/16, G/8, 320]`` -> ``(d, dmin, sc, m)``, fp16 ``[N, G/8]``
    and uint8 ``[N, G]``, the very fields packed (what a GGUF Q4_K block holds, dead groups' included).

    Example:
        >>> d, dmin = torch.full((16, 1), 0.5, dtype=torch.float16), torch.full((16, 1), 0.25, dtype=torch.float16)
        >>> sc, m = torch.arange(8).repeat(16, 1), torch.full((16, 8), 2)
        >>> got = unpack_k_scales(pack_k_scales(d, dmin, sc, m))
        >>> all(torch.equal(a.to(b.dtype), b) for a, b in zip(got, (d, dmin, sc, m)))
        True
    """
    nb, s, _ = k.shape
    head = k[..., :64].contiguous().view(torch.float16).reshape(nb, s, 2, ROWS)  # [nb, S, d|dmin, r]
    d, dmin = (head[:, :, i].permute(0, 2, 1).reshape(nb * ROWS, s) for i in range(2))
    body = k[..., 64:].reshape(nb, s, K_SUPER, 2, ROWS).permute(3, 0, 4, 1, 2)  # [sc|m, nb, r, S, 8]
    sc, m = (body[i].reshape(nb * ROWS, s * K_SUPER) for i in range(2))
    return d.contiguous(), dmin.contiguous(), sc.contiguous(), m.contiguous()


def k_scale_min(k: torch.Tensor) -> torch.Tensor:
    """:func:`pack_k_scales`'s bytes as the fp32 ``scale_min`` ``[N/16, G, 2, 16]`` the kernels also take: ``d * sc``
    and ``-dmin * m``, exact in fp32 (an fp16 times a 6-bit integer)."""
    nb, s, _ = k.shape
    head = k[..., :64].contiguous().view(torch.float16).reshape(nb, s, 2, 1, ROWS).float()  # [nb, S, 2, 1, 16]
    body = k[..., 64:].reshape(nb, s, K_SUPER, 2, ROWS).float()  # [nb, S, 8, 2, 16]
    sign = torch.tensor([1.0, -1.0]).view(1, 1, 1, 2, 1)
    return (head.transpose(2, 3) * sign * body).reshape(nb, s * K_SUPER, 2, ROWS)


K6_SUPER = 16
"""Scale groups (of 16 inputs) per super-block of a Q6_K scale (:func:`pack_k6_scales`)."""


def pack_k6_scales(d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """Q6_K's two-level scales in the int8 layout's blocks (module docstring): ``d`` fp16 ``[N, Gw/16]`` and ``sc``
    ``[N, Gw]`` integers -128..127 -> uint8 ``[N/16, Gw/16, 288]``; the scale of group ``j`` is ``d * sc_j``.

    Example:
        >>> d, sc = torch.full((16, 1), 0.5, dtype=torch.float16), torch.arange(-8, 8).repeat(16, 1)
        >>> k6_block_scales(pack_k6_scales(d, sc))[0, :3, 0].tolist()
        [-4.0, -3.5, -3.0]
    """
    n, g = sc.shape
    _check_rows(n)
    if g % K6_SUPER or tuple(d.shape) != (n, g // K6_SUPER):
        raise ValueError(f"pack_k6_scales: sc [{n}, {g}] needs d [{n}, {g // K6_SUPER}] and groups in whole "
                         f"super-blocks of {K6_SUPER}, got d {tuple(d.shape)}")
    if int(sc.min()) < -128 or int(sc.max()) > 127:
        raise ValueError("pack_k6_scales: sc must be integers -128..127 (Q6_K's 8-bit scales)")
    nb, s = n // ROWS, g // K6_SUPER
    head = d.to(torch.float16).reshape(nb, ROWS, s).transpose(1, 2).contiguous().view(torch.uint8)  # [nb, S, 32]
    body = sc.to(torch.int8).reshape(nb, ROWS, s, K6_SUPER).permute(0, 2, 3, 1).contiguous().view(torch.uint8)
    return torch.cat([head, body.reshape(nb, s, K6_SUPER * ROWS)], -1).contiguous()


def unpack_k6_scales(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_k6_scales`: uint8 ``[N/16, Gw/16, 288]`` -> ``(d, sc)``, fp16 ``[N, Gw/16]`` and
    int8 ``[N, Gw]``, the very fields packed (what a GGUF Q6_K block holds).

    Example:
        >>> d, sc = torch.full((16, 1), 0.5, dtype=torch.float16), torch.arange(-8, 8).repeat(16, 1)
        >>> d2, sc2 = unpack_k6_scales(pack_k6_scales(d, sc))
        >>> torch.equal(d2, d), torch.equal(sc2, sc.to(torch.int8))
        (True, True)
    """
    nb, s, _ = k.shape
    d = k[..., :2 * ROWS].contiguous().view(torch.float16).reshape(nb, s, ROWS).transpose(1, 2)  # [nb, r, S]
    sc = k[..., 2 * ROWS:].contiguous().view(torch.int8).reshape(nb, s, K6_SUPER, ROWS).permute(0, 3, 1, 2)
    return d.reshape(nb * ROWS, s).contiguous(), sc.reshape(nb * ROWS, s * K6_SUPER).contiguous()


def k6_block_scales(k: torch.Tensor) -> torch.Tensor:
    """:func:`pack_k6_scales`'s bytes as the blocked fp32 scales ``[N/16, Gw, 16]`` (:func:`block_scales`) they
    stand for, ``d * sc``, exact in fp32."""
    nb, s, _ = k.shape
    d = k[..., :2 * ROWS].contiguous().view(torch.float16).float().unsqueeze(2)  # [nb, S, 1, 16]
    sc = k[..., 2 * ROWS:].contiguous().view(torch.int8).reshape(nb, s, K6_SUPER, ROWS).float()
    return (d * sc).reshape(nb, s * K6_SUPER, ROWS)


def factor_two_level(values: torch.Tensor, most: int, low: int, exact) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Values ``[N, S, k]`` as ``unit * multiple`` per super-block of ``k``: ``(unit fp32 [N, S], multiples [N, S,
    k])``, each unit an fp16 value and each multiple an integer in ``low..most`` with ``exact(unit, multiples)`` true
    for its super-block (``[N, S]`` bools), or None where some super-block has none. Tries each super-block's largest
    magnitude as ``most``, ``most - 1``, ... 1 units (a GGUF quantizer gives it the top one or close to it); an
    all-zero super-block is unit 0. How a layer's scales are found to be a Q4_K or Q6_K file's two levels."""
    top = values.abs().amax(-1)
    unit, mult = torch.zeros_like(top), torch.zeros_like(values)
    found = top == 0
    for c in range(most, 0, -1):
        u = (top / c).to(torch.float16).float()
        q = torch.round(values / torch.where(u == 0, torch.ones_like(u), u).unsqueeze(-1))
        ok = ~found & (u > 0) & (u.to(torch.float16).float() == u) & ((q >= low) & (q <= most)).all(-1) & exact(u, q)
        unit, mult = torch.where(ok, u, unit), torch.where(ok.unsqueeze(-1), q, mult)
        found |= ok
        if bool(found.all()):
            return unit, mult
    return None


def scale_min_rows(scale_min: torch.Tensor) -> torch.Tensor:
    """``[2, N, G]`` fp32 row-major scales and minimums of any form of ``scale_min`` (module docstring)."""
    if scale_min.dtype == torch.uint8:  # Q4_K's two-level scales
        scale_min = k_scale_min(scale_min)
    if scale_min.dim() == 3:  # symmetric: fp16 scales, minimum -8 x scale
        scale = scale_min.float().transpose(1, 2).reshape(-1, scale_min.shape[1])
        return torch.stack([scale, -8.0 * scale])
    return scale_min.float().permute(2, 0, 3, 1).reshape(2, scale_min.shape[0] * ROWS, -1)


def _unit_sc(k: torch.Tensor) -> torch.Tensor:
    # Q4_K scale bytes with every sc set to 1: k_scale_min of it gives each group its super-block's d
    k = k.clone()
    k[..., 64:].view(*k.shape[:2], K_SUPER, 2, ROWS)[:, :, :, 0] = 1
    return k


def blocked_int4_codes(weight: torch.Tensor) -> torch.Tensor:
    """The codes uint8 ``[N, K]`` of an int4 block-layout weight, as packed (a dead group's too: what a GGUF file's
    Q4_K block holds there)."""
    nb, chunks, _ = weight.shape
    b = weight.reshape(nb, chunks, ROWS, 4).permute(0, 2, 1, 3)  # [blk, r, chunk, j]
    return torch.stack([b & 0x0F, b >> 4], 3).reshape(nb * ROWS, chunks * 8)


def unpack_blocked_int4(weight: torch.Tensor, scale_min: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_blocked_int4` (and :func:`pack_blocked_int4_sym`): ``(codes uint8 [N, K], scales
    fp32 [N, G], zeros fp32 [N, G])``."""
    codes = blocked_int4_codes(weight)
    sm = scale_min_rows(scale_min)  # [2, N, G]
    if scale_min.dim() == 3 and scale_min.dtype != torch.uint8:
        return codes, sm[0].clone(), torch.full_like(sm[0], 8.0)
    scale, low = sm[0].clone(), sm[1]
    dead = scale == 0  # (Q4_K's sc = 0) the group is its minimum whatever its codes: codes 0, the super-block's d as
    # the scale (1 where d is 0 too), so that the portable form keeps (code - zero) * scale = min
    if bool(dead.any()):
        codes = codes.view(*scale.shape, -1).masked_fill(dead.unsqueeze(-1), 0).view(codes.shape)
        d = k_scale_min(_unit_sc(scale_min))[:, :, 0].transpose(1, 2).reshape(scale.shape) \
            if scale_min.dtype == torch.uint8 else torch.zeros_like(scale)
        scale = torch.where(dead, torch.where(d == 0, torch.ones_like(d), d), scale)
    return codes, scale, -low / scale


def pack_blocked_int8(codes: torch.Tensor) -> torch.Tensor:
    """Int8 codes ``[N, K]`` into the int8 block layout (module docstring): uint8 ``[N/16, K/4, 64]``, each code plus
    128.

    Example:
        >>> codes = torch.tensor([[-128, -1, 0, 127]], dtype=torch.int8).repeat(16, 1)
        >>> w = pack_blocked_int8(codes)
        >>> w.dtype, w[0, 0, :4].tolist(), torch.equal(unpack_blocked_int8(w), codes)
        (torch.uint8, [0, 127, 128, 255], True)
    """
    n, k = codes.shape
    _check_rows(n)
    blocks = codes.to(torch.int8).reshape(n // ROWS, ROWS, k // 4, 4).permute(0, 2, 1, 3)
    return biased(blocks).view(n // ROWS, k // 4, 4 * ROWS)


def biased(codes: torch.Tensor) -> torch.Tensor:
    """Int8 codes as the int8 block layout stores them, uint8 ``code + 128``; on uint8 input, the int8 codes back. Each
    byte's sign bit flipped in one pass into a new contiguous tensor of ``codes``' shape (``codes`` may be any view:
    the packing's reordering and the flip are that one pass)."""
    out = torch.empty(codes.shape, dtype=torch.uint8, device=codes.device)
    torch.bitwise_xor(codes.view(torch.uint8), 0x80, out=out)
    return out if codes.dtype == torch.int8 else out.view(torch.int8)


def block_scales(scale: torch.Tensor) -> torch.Tensor:
    """Group scales ``[N, Gw]`` in the int8 layout's blocks, ``[N/16, Gw, 16]``: a block's 16 rows side by side per
    group, as the kernel reads them.

    Example:
        >>> s = torch.arange(64.).view(32, 2)
        >>> block_scales(s)[1, 0, :3].tolist(), torch.equal(unblock_scales(block_scales(s)), s)
        ([32.0, 34.0, 36.0], True)
    """
    n, g = scale.shape
    _check_rows(n)
    return scale.reshape(n // ROWS, ROWS, g).transpose(1, 2).contiguous()


def unblock_scales(scale: torch.Tensor) -> torch.Tensor:
    """:func:`block_scales` undone: ``[N/16, Gw, 16]`` -> ``[N, Gw]``."""
    return scale.transpose(1, 2).reshape(-1, scale.shape[1])


def unpack_blocked_int8(weight: torch.Tensor) -> torch.Tensor:
    """The int8 codes ``[N, K]`` of an int8 block-layout weight."""
    nb, chunks, _ = weight.shape
    return biased(weight.reshape(nb, chunks, ROWS, 4).permute(0, 2, 1, 3)).view(nb * ROWS, chunks * 4)


def _group_dots(q: torch.Tensor, codes: torch.Tensor, group: int) -> torch.Tensor:
    # exact integer dot products per (row, output, group) in fp32 (|sum| < 2**24 for groups up to 256 columns)
    m, k = q.shape
    return torch.einsum("mgk,ngk->mng", q.float().reshape(m, k // group, group),
                        codes.float().reshape(codes.shape[0], k // group, group))


def int4_a8_reference(x: torch.Tensor, weight: torch.Tensor, scale_min: torch.Tensor, group: int) -> torch.Tensor:
    """:func:`int4_a8_linear` in torch operations (any device): ``x [M, K]`` -> ``[M, N]`` in ``x.dtype``."""
    q, sx = quantize_activations(x, group)
    codes, _, _ = unpack_blocked_int4(weight, scale_min)
    sm = scale_min_rows(scale_min)  # [2, N, G]
    dots = _group_dots(q, codes, group)  # [M, N, G]
    qsum = q.float().reshape(q.shape[0], -1, group).sum(-1)  # [M, G]
    y = (dots * sm[0] * sx[:, None, :]).sum(-1) + ((sx * qsum)[:, None, :] * sm[1]).sum(-1)
    return y.to(x.dtype)


def int8_a8_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """:func:`int8_a8_linear` in torch operations (any device): ``x [M, K]`` -> ``[M, N]`` in ``x.dtype``."""
    q, sx = quantize_activations(x, group)
    dots = _group_dots(q, unpack_blocked_int8(weight), group)  # [M, N, G]
    if scale.dtype == torch.uint8:  # Q6_K's two-level scales
        scale = k6_block_scales(scale)
    if scale.dim() == 3:  # blocked: one scale per row and weight group, over whole activation groups
        scale = unblock_scales(scale)
        sw = scale.float().repeat_interleave(dots.shape[-1] // scale.shape[1], dim=1)  # [N, G]
        return (dots * (sx[:, None, :] * sw)).sum(-1).to(x.dtype)
    return ((dots * sx[:, None, :]).sum(-1) * scale.float()).to(x.dtype)


def int4_a8_linear(x: torch.Tensor, weight: torch.Tensor, scale_min: torch.Tensor, group: int) -> torch.Tensor:
    """``x [..., K]`` times an int4 block-layout weight with int8 dynamic activations: ``[..., N]`` in ``x.dtype``
    (float32 or bfloat16 on the C++ kernel; any float dtype on the reference).

    Example:
        >>> from infopt.quantize.formats.int4 import quantize_int4_grouped
        >>> w = torch.randn(32, 64)
        >>> weight, sm = pack_blocked_int4(*quantize_int4_grouped(w, 32))
        >>> x = torch.randn(2, 64)
        >>> y = int4_a8_linear(x, weight, sm, 32)
        >>> y.shape, bool(torch.allclose(y, int4_a8_reference(x, weight, sm, 32), atol=1e-4))
        (torch.Size([2, 32]), True)
    """
    x2 = x.reshape(-1, x.shape[-1])
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and available():
        _count("int4_a8_linear")
        y = torch.ops.infopt.int4_a8_linear(x2, weight, scale_min, group)
    else:
        _count("reference")
        y = int4_a8_reference(x2, weight, scale_min, group)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def int4_a8_linear_n(x: torch.Tensor, weights: list[torch.Tensor], scale_mins: list[torch.Tensor],
                     group: int) -> list[torch.Tensor]:
    """Several int4 block-layout weights on one input ``x [M, K]`` (fused q/k/v or gate/up): the activations are
    quantized once and every weight's blocks share one parallel region. Each output equals
    :func:`int4_a8_linear` with that weight alone, bit for bit."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and available():
        _count("int4_a8_linear_n")
        return list(torch.ops.infopt.int4_a8_linear_n(x, weights, scale_mins, group))
    _count("reference")
    return [int4_a8_reference(x, w, sm, group) for w, sm in zip(weights, scale_mins, strict=True)]


def int8_a8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """``x [..., K]`` times an int8 block-layout weight (``scale`` per row ``[N]``, or per row and group of whole
    activation groups, blocked by :func:`block_scales`) with int8 dynamic activations.

    Example:
        >>> codes = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
        >>> weight = pack_blocked_int8(codes)
        >>> scale, x = block_scales(torch.rand(32, 2) / 100), torch.randn(3, 64)
        >>> y = int8_a8_linear(x, weight, scale, 16)
        >>> bool(torch.allclose(y, int8_a8_reference(x, weight, scale, 16), atol=1e-5))
        True
    """
    x2 = x.reshape(-1, x.shape[-1])
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and available():
        _count("int8_a8_linear")
        y = torch.ops.infopt.int8_a8_linear(x2, weight, scale, group)
    else:
        _count("reference")
        y = int8_a8_reference(x2, weight, scale, group)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def int8_f32_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` fp32 times an int8 weight ``[N, K]`` with one scale per row (``scale [N]``) or per row and group
    of ``K // G`` input channels (``scale [N, G]``): ``[..., N]`` fp32, accumulated in fp32 (only the weight is
    rounded). The C++ kernel on CPU (any number of rows: measured faster than an fp32 GEMM over the dequantized
    weight from 4 to 2,048 rows), else torch.

    Example:
        >>> w = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
        >>> s, x = torch.rand(32) / 100, torch.randn(3, 64)
        >>> torch.allclose(int8_f32_linear(x, w, s), x @ (w.float() * s[:, None]).t(), atol=1e-4)
        True
    """
    x2 = x.reshape(-1, x.shape[-1])
    if x.device.type == "cpu" and x.dtype == torch.float32 and available():
        _count("int8_f32_linear")
        y = torch.ops.infopt.int8_f32_linear(x2, weight, scale)
    else:
        _count("reference")
        if scale.dim() == 2:
            w = dequantize(weight, group_block(weight.shape, weight.shape[1] // scale.shape[1]), scale)
            y = F.linear(x2.float(), w)
        else:
            y = F.linear(x2.float(), weight.float()) * scale.float()
    return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)


def int4_dense_t_reference(weight: torch.Tensor, scale_min: torch.Tensor, group: int,
                           dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """:func:`int4_dense_t` in torch operations (any device)."""
    codes, _, _ = unpack_blocked_int4(weight, scale_min)
    sm = scale_min_rows(scale_min).double().repeat_interleave(group, dim=-1)  # [2, N, K]
    # code * scale + min is exact in float64 (a 4-bit code times a bf16 scale, plus a bf16), so rounding it to
    # fp32 gives the kernel's fused multiply-add, and then to bf16 (ties to even) the kernel's bf16 output
    return (codes.double() * sm[0] + sm[1]).float().to(dtype).t().contiguous()


def int4_dense_t(weight: torch.Tensor, scale_min: torch.Tensor, group: int,
                 dtype: torch.dtype = torch.bfloat16, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The int4 block-layout weight dequantized and transposed: ``[K, N]`` in ``dtype`` (bfloat16 or float32),
    ``w = code * scale + min`` by a fused multiply-add in fp32 (then rounded to bf16, ties to even). Prompts
    multiply by it: past a few dozen rows one GEMM over a weight dequantized on the fly beats the integer kernel,
    and no layer keeps a dense copy. ``out``: a contiguous ``[K, N]`` tensor of ``dtype`` to write into and return
    (:func:`dense_scratch`), instead of a new one.

    Example:
        >>> from infopt.quantize.formats.int4 import quantize_int4_grouped
        >>> weight, sm = pack_blocked_int4(*quantize_int4_grouped(torch.randn(32, 64), 32))
        >>> wt = int4_dense_t(weight, sm, 32)
        >>> wt.shape, wt.dtype, bool(torch.equal(wt, int4_dense_t_reference(weight, sm, 32)))
        (torch.Size([64, 32]), torch.bfloat16, True)
    """
    if out is not None and out.dtype != dtype:
        raise ValueError(f"int4_dense_t: out is {out.dtype}, dtype is {dtype}; pass an out of the dtype asked")
    if weight.device.type == "cpu" and available():
        _count("int4_a8_dense_t")
        if out is None:
            return torch.ops.infopt.int4_a8_dense_t(weight, scale_min, group, dtype)
        torch.ops.infopt.int4_a8_dense_t_out(weight, scale_min, group, out)
        return out
    _count("reference")
    ref = int4_dense_t_reference(weight, scale_min, group, dtype)
    return ref if out is None else out.copy_(ref)


_SCRATCH = threading.local()


def dense_scratch(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A ``[rows, cols]`` CPU tensor of ``dtype`` for :func:`int4_dense_t`'s ``out``: a view of one buffer per
    thread and dtype, kept and grown to the largest size asked, which every call then overwrites.

    Why: a prompt's layers each dequantize a weight for one GEMM and drop it, and a new buffer of that size is new
    pages to the operating system every time (past glibc's 32 MB a ``malloc`` maps fresh memory), which cost more
    than the dequantization itself where first touches are slow (a [4096, 14336] bf16 copy: 35 ms into a new
    buffer, 4 ms into a kept one, on a 2-core EPYC VM: ``benchmarks/studies/fresh_pages.py``). The price: the largest such weight stays allocated, once
    per thread that ran a prompt (Llama-3.1-8B's MLP: 117 MB). Only for a result used at once and not kept: not
    for autograd (a saved operand would be overwritten by the next layer) or a traced graph. The buffer is a normal
    tensor, also when first asked for under ``torch.inference_mode``, so calls in and out of inference mode share it."""
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = {}
    need = rows * cols
    buf = bufs.get(dtype)
    if buf is None or buf.numel() < need:
        # a normal tensor even when the first prompt runs under torch.inference_mode: an inference tensor could not
        # be written to by a later prompt outside it
        with torch.inference_mode(False):
            buf = bufs[dtype] = torch.empty(need, dtype=dtype)
    return buf[:need].view(rows, cols)
