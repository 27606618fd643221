"""Int4 weight-only quantization: grouped asymmetric (or symmetric) round-to-nearest, packed two per byte.

:class:`Int4Linear` keeps its weights in the layout of the fastest kernel for its device and
converts to and from one portable layout when saved or loaded:

- ``cpu_int4pack``: ``torch._weight_int4pack_mm_for_cpu`` (bf16 activations), CPU.
- ``cuda_tinygemm``: ``torch._weight_int4pack_mm`` (bf16 activations), CUDA.
- ``gemv``: the portable codes with bf16 ``(scale, offset)`` pairs ``[out, in // group_size, 2]`` (tinygemm's
  values, row-major), multiplied by infopt's Triton kernel at up to eight rows
  (:func:`infopt.ops.triton_gemv.w4_gemv`) and dequantized to the activation dtype above that (prompts);
  chosen with ``Int4WeightOnly(cuda_kernel="gemv")``. Slower than tinygemm on an H200 (17-23% of the copy bandwidth at
  one row against 31-34%); elsewhere than CUDA it computes the kernel's reference.
- ``plain``: the portable layout itself, dequantized per call (any device; the reference path).
- ``a8``: int8 dynamic activations times the int4 codes in integers (``activations="int8"``; lossy beyond the
  weights): the C++ kernel of :mod:`infopt.quantize.formats.a8` on the CPU, its torch reference elsewhere.

Each layout is a small class of :mod:`infopt.quantize.formats.int4_layouts` (its buffers, packing, unpacking and
product); the layer holds the layout's name. :func:`kernel_calls` counts which kernel each forward ran.

Portable layout (the ``state_dict``): ``qweight`` uint8 ``[out, in // 2]`` (column ``2j`` in the low
nibble, ``2j + 1`` in the high one), ``scales`` fp32 ``[out, in // group_size]``, ``zeros`` fp32
``[out, in // group_size]`` (zero points: integers from GPTQ/AWQ and ``zero_point="int"``, any value
with ``zero_point="float"``), optional ``in_perm`` int64 ``[in]``. A weight is ``(code - zero) * scale``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ...core.availability import fast_bf16_gemm
from ...core.errors import IncompatibleModelError, RecipeError
from ...core.introspect import inspect_model
from ...core.step import StepConfig, bad_field, register_step
from ..api import KERNEL_GROUP_SIZES, check_group_size, check_keep, keep_level, quantize_targets, register_quantizer
from ..bound import HoldsBound
from ..experts import QuantizedExperts, check_experts_shapes, register_experts_quantizer
from . import a8
from .int4_layouts import A8_LAYOUTS, A8_PROMPT_MIN_ROWS, BUFFERS, LAYOUTS, cuda_inner_k_tiles
from .int8 import Int8WeightOnly
from .primitives import KeepsFormat, choose_qparams, dequantize, group_block, pack_int4, quantize, unpack_int4

__all__ = ["Int4WeightOnly", "Int4Linear", "quantize_int4_grouped", "pack_int4", "unpack_int4", "KERNEL_GROUP_SIZES",
           "cuda_inner_k_tiles", "layout_for", "CUDA_KERNELS", "KERNELS", "kernel_calls", "A8_PROMPT_MIN_ROWS"]
# cuda_inner_k_tiles and A8_PROMPT_MIN_ROWS are infopt.quantize.formats.int4_layouts', named here too
# pack_int4 / unpack_int4 are infopt.quantize.formats.primitives' (the portable layout is their default), named here too

KERNELS = ("cpu_int4pack", "cuda_tinygemm", "a8", "a8_prompt", "gemv", "gemv_prompt", "plain", "dense")
"""Keys of :func:`kernel_calls`: a layout's kernel (``a8``: :func:`infopt.quantize.formats.a8.int4_a8_linear`, whose own count
says whether its C++ kernel ran), ``*_prompt`` (the weight dequantized for one call of many rows), ``plain`` (the torch
reference: dequantized per call), ``dense`` (the resident copy of ``dense_prefill``)."""

_CALLS = dict.fromkeys(KERNELS, 0)  # eager forwards per kernel since import (a diagnostic: unlocked, += under the GIL)


def kernel_calls() -> dict[str, int]:
    """Eager :class:`Int4Linear` forwards since import per kernel that served them (:data:`KERNELS`); a forward traced
    into a compiled graph is not counted (the graph calls the kernel itself). Take the difference of two snapshots.

    Example:
        >>> before = kernel_calls()["plain"]
        >>> _ = Int4Linear.from_float(nn.Linear(64, 32), group_size=32, layout="plain")(torch.randn(1, 64))
        >>> kernel_calls()["plain"] - before
        1
    """
    return dict(_CALLS)


CUDA_KERNELS = ("tinygemm", "gemv")
"""Values of :attr:`Int4WeightOnly.cuda_kernel`."""


@register_step
@dataclass(frozen=True)
class Int4WeightOnly(StepConfig, HoldsBound):
    """Weights stored as 4-bit codes (two per byte) with one scale and zero point per group of
    ``group_size`` input channels; activations stay floating point (bf16 inside the fused kernel).

    Args:
        group_size: input channels per scale/zero (32, 64, 128 or 256). It must divide every
            quantized layer's ``in_features`` (the default model's 576 takes 32 or 64, not 128).
        symmetric: zero point fixed at 8 (codes -8..7 around zero) instead of fitted per group.
        zero_point: ``"float"`` (default): each group's 16 levels span exactly its min..max, which
            the kernels take natively (they add a float offset); ``"int"``: an integer zero point,
            the GPTQ checkpoint convention (needed to export in that layout), slightly coarser.
        include_lm_head: also quantize the output head. When it is tied to the input embedding,
            the head gets its own quantized copy and the embedding stays as it is (lookups read one
            row; the head reads all of it every token).
        lm_head_bits: 8 (default) or 4: the head's format when ``include_lm_head``. The head decides
            every token directly, so it is the most sensitive layer: on the default model an int4
            head costs ~18x the KL of an int8 one.
        activations: ``"float"`` (default): activations stay floating point (bf16 in the kernel);
            ``"int8"``: each call quantizes its activations to int8 per row and group of ``group_size``
            channels and multiplies them with the int4 codes in integers (:mod:`infopt.quantize.formats.a8`,
            AVX512-VNNI or AVX2 on CPUs that have them). Faster at one to a few rows, and a further lossy step with
            its own KL/top-1 figures; the head, when quantized to int8, takes int8 activations too.
            ``"auto"``: ``"int8"`` where the C++ kernel runs with AVX512-VNNI or AVX2, else ``"float"``
            (:func:`infopt.quantize.formats.a8.resolve`; the ``cpu-fast`` preset's choice).
        dense_prefill: also keep each weight dequantized in bf16 (2 bytes per weight more) and use it
            for calls of :data:`DENSE_MIN_ROWS` rows or more (:data:`A8_DENSE_MIN_ROWS` in the ``a8``
            layout): prompts, batches, speculative verification. The int4 kernel's time grows with the rows much
            faster than a bf16 GEMM's: on a 2-core AVX512-BF16 CPU a 576x1536 layer takes 0.71 ms (int4) against
            0.42 ms (bf16) at 64 rows, 5.6 against 2.6 ms at 512 (fp32: 5.7 ms; ``benchmarks/int4_rows.py``).
            For time to first token, at the cost of memory; the ``a8`` layout needs no copy (from
            :data:`A8_PROMPT_MIN_ROWS` rows it dequantizes each weight for the call and runs one GEMM).
        share_embedding: with an int8 head (``include_lm_head``, ``lm_head_bits=8``) tied to the input
            embedding, the embedding reads its rows from the head's codes instead of keeping its float weight
            (see :class:`infopt.quantize.formats.int8.SharedInt8Embedding`).
        cuda_kernel: ``"tinygemm"`` (default): layers on a CUDA device take torch's int4 kernel and its packed layout;
            ``"gemv"``: infopt's Triton matrix-vector kernel at one to eight rows, reading the packed codes once
            (the ``gemv`` layout, on any device: elsewhere than CUDA it computes the kernel's reference, slowly);
            an int8 head takes the 8-bit one (``Int8WeightOnly(cuda_kernel="gemv")``).
            On an H200, batch-1 decode of an 8B Llama: tinygemm 1.21x ``gpu-fast`` in bf16, the GEMV kernel 0.92x
            (``benchmarks/gpu_gemv.py``: 31-34% against 17-23% of the copy bandwidth at one row; the fifth GPU lane
            run), so tinygemm stays the default.
        experts: on a mixture-of-experts model, also quantize the experts (default True; they hold most of the
            weights): each expert's ``gate_up`` and ``down`` become :class:`Int4Linear` layers with their own
            scales (:class:`infopt.quantize.experts.QuantizedExperts`). Routers and shared-expert gates stay in
            float. ``include``/``exclude`` globs match the experts module's name (``"*.mlp.experts"``).
        max_kl: a bound on the step's error, in nats/token of KL divergence against the unquantized model (None:
            no bound). When applied, the step measures its KL on 256 tokens of calibration text and, where the bound
            breaks, keeps the layers whose error costs most in higher precision until it holds (int8 activations
            dropped first, then 8-bit weights, then float), writing them into ``keep``; the report says what it
            kept and why (:mod:`infopt.quantize.bound`). The ``cpu-fast`` and ``memory-saver`` presets set 0.02.
        keep: ``"PATTERN=LEVEL"`` entries keeping matching layers (a glob on the dotted name) at a level of
            :data:`infopt.quantize.api.KEEP_LEVELS`: ``float-activations``, ``int8`` or ``float``. A saved model's
            recipe carries the entries its bound chose, so loading rebuilds the same layers.

    Raises:
        RecipeError: a group size the kernels do not take, a non-boolean flag, a malformed ``keep`` entry or bound.

    Example:
        >>> from infopt.models import tiny_model
        >>> from infopt.quantize import quantize_
        >>> m = quantize_(tiny_model(), Int4WeightOnly(group_size=32))
        >>> type(m.model.layers[0].mlp.up_proj).__name__
        'Int4Linear'
    """

    stage: ClassVar[str] = "quantize"
    kind: ClassVar[str] = "int4"
    discriminator: ClassVar[str] = "method"
    group_size: int = 128
    symmetric: bool = False
    zero_point: str = "float"
    include_lm_head: bool = False
    lm_head_bits: int = 8
    dense_prefill: bool = False
    activations: str = "float"
    share_embedding: bool = False
    experts: bool = True
    cuda_kernel: str = "tinygemm"
    max_kl: float | None = None
    keep: tuple[str, ...] = ()

    def __post_init__(self):
        check_keep(self)
        if self.cuda_kernel not in CUDA_KERNELS:
            raise bad_field(self, "cuda_kernel", self.cuda_kernel, ", ".join(CUDA_KERNELS))
        if type(self.group_size) is not int or self.group_size not in KERNEL_GROUP_SIZES:
            raise bad_field(self, "group_size", self.group_size, ", ".join(map(str, KERNEL_GROUP_SIZES)))
        if self.lm_head_bits not in (4, 8) or isinstance(self.lm_head_bits, bool):
            raise bad_field(self, "lm_head_bits", self.lm_head_bits, "4, 8")
        if self.zero_point not in ("float", "int"):
            raise bad_field(self, "zero_point", self.zero_point, "float, int")
        if self.activations not in a8.ACTIVATIONS:
            raise bad_field(self, "activations", self.activations, ", ".join(a8.ACTIVATIONS))
        for name in ("symmetric", "include_lm_head", "dense_prefill", "share_embedding", "experts"):
            if not isinstance(getattr(self, name), bool):
                raise bad_field(self, name, getattr(self, name), "true or false")
        if self.share_embedding and not (self.include_lm_head and self.lm_head_bits == 8):
            raise RecipeError("Int4WeightOnly(share_embedding=True) shares the int8 output head's codes with the input "
                              "embedding, so it needs include_lm_head=True and lm_head_bits=8")

    def check(self, model, info, steps):
        check_int4_shapes(model, self, self.group_size)
        check_experts_shapes(model, self, self.group_size, out_multiple=16)
        return []

    def head_config(self) -> StepConfig | None:
        """The config the output head is quantized with (see ``lm_head_bits``)."""
        if self.lm_head_bits == 8:
            return Int8WeightOnly(activations=self.activations, include_lm_head=self.include_lm_head,
                                  share_embedding=self.share_embedding,
                                  cuda_kernel="gemv" if self.cuda_kernel == "gemv" else "tl_dot")
        return None

    def kept_as(self, level: str) -> StepConfig:
        """The config of one layer kept at ``level`` (``float-activations`` or ``int8``; see ``keep``).

        Example:
            >>> Int4WeightOnly(group_size=32, activations="int8").kept_as("float-activations").activations
            'float'
        """
        if level == "float-activations":
            return dataclasses.replace(self, activations="float", keep=(), max_kl=None)
        if level == "int8":
            return Int8WeightOnly(cuda_kernel="gemv" if self.cuda_kernel == "gemv" else "tl_dot")
        raise ValueError(f"Int4WeightOnly.kept_as: unknown level {level!r}")


def check_int4_shapes(model: nn.Module, config: StepConfig, group_size: int) -> None:
    """Raise :class:`IncompatibleModelError` for a layer the int4 kernels cannot take: ``group_size`` not dividing
    its ``in_features`` (see :func:`infopt.quantize.api.check_group_size`), or output features not a multiple of 16."""
    head = inspect_model(model).lm_head_fqn
    # the head is quantized with another config when head_config() gives one
    skip = (head,) if getattr(config, "head_config", lambda: None)() is not None else ()
    # layers ``keep`` holds at 8 bits are no int4 layers
    skip += tuple(t.fqn for t in quantize_targets(model, config) if keep_level(config, t.fqn) == "int8")
    check_group_size(model, config, group_size, skip=skip)
    for t in quantize_targets(model, config):
        if t.fqn not in skip and t.weight.shape[0] % 16:
            raise IncompatibleModelError(
                f"{type(config).__name__}: {t.fqn} has {t.weight.shape[0]} output features; the int4 kernels need a "
                "multiple of 16. Exclude it with exclude=[...]"
            )


def quantize_int4_grouped(w: torch.Tensor, group_size: int, symmetric: bool = False, zero_point: str = "int"
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit quantization per group of input channels.

    Args:
        w: ``[out, in]`` float weight, ``in`` divisible by ``group_size``.
        group_size: input channels per group.
        symmetric: zero point 8 and scale ``absmax / 7.5`` instead of min/max fitting.
        zero_point: ``"int"``: the range is widened to include 0 and the zero point rounded to an
            integer; ``"float"``: the 16 levels span the group's min..max exactly (fractional zero point).

    Returns:
        ``(codes, scales, zeros)``: uint8 ``[out, in]`` in 0..15, fp32 ``[out, G]``, fp32 ``[out, G]``,
        with ``w ~= (codes - zeros) * scales`` per group. Scales are at least ``1e-8``.

    Example:
        >>> w = torch.randn(16, 64)
        >>> c, s, z = quantize_int4_grouped(w, 32)
        >>> bool(((c.float() - z.float().repeat_interleave(32, 1)) * s.repeat_interleave(32, 1) - w).abs().max()
        ...      <= s.max() / 2 + 1e-6)
        True
    """
    w32 = w.detach().float()
    block = group_block(w32.shape, group_size)  # (1, group_size)
    # a symmetric grid's zero point is the middle code, 8
    domain = "int" if symmetric else zero_point
    scale, zero = choose_qparams(w32, block, qmin=0, qmax=15, symmetric=symmetric, zero_domain=domain, eps=1e-8)
    return quantize(w32, block, scale, zero, qmin=0, qmax=15), scale, zero


def layout_for(device: torch.device, in_features: int, out_features: int, group_size: int) -> str:
    """The layout an :class:`Int4Linear` takes on ``device`` (see the module docstring): the device's kernel
    where it exists and takes the shape, else ``"plain"``.

    Example:
        >>> layout_for(torch.device("cuda"), 576, 1536, 32), layout_for(torch.device("cuda"), 48, 64, 16)
        ('cuda_tinygemm', 'plain')
    """
    if out_features % 16 or group_size not in KERNEL_GROUP_SIZES:
        return "plain"
    if device.type == "cpu" and hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        return "cpu_int4pack"
    if device.type == "cuda" and hasattr(torch, "_weight_int4pack_mm") and cuda_inner_k_tiles(in_features):
        return "cuda_tinygemm"
    return "plain"


_PORTABLE = ("qweight", "scales", "zeros")

DENSE_MIN_ROWS = 8
"""Rows from which an :class:`Int4Linear` with a dense copy multiplies by it (the measured crossover on a
2-core AVX512-BF16 CPU: at 8 rows a 576x1536 layer takes 0.105 ms in the int4 kernel, 0.095 ms in bf16;
``benchmarks/int4_rows.py``)."""


DENSE_FP32_MIN_ROWS = 16
"""The same for a copy kept in fp32, on CPUs without native bf16 GEMMs (2-core AVX2 EPYC, 576x1536: at 8 rows 0.24 ms
against 0.21 in the int4 kernel, at 16 rows 0.32 against 0.41; a bf16 copy there takes 1.5 ms)."""


A8_DENSE_MIN_ROWS = 32
"""The same crossover for the ``a8`` layout, whose integer kernel stays ahead of a bf16 GEMM up to ~32 rows (576x1536
at 16 rows: 0.056 ms against 0.078; at 32: equal; at 512: 1.5 ms against 0.74, on AMX)."""

_FAST_BF16 = [fast_bf16_gemm()]


class Int4Linear(KeepsFormat):
    """A linear layer with grouped 4-bit weights (see the module docstring for the layouts).

    Build with :meth:`from_float` (round-to-nearest) or :meth:`from_codes` (codes computed
    elsewhere, e.g. by GPTQ or AWQ). ``layout`` says which kernel runs.
    """

    def __init__(self, in_features: int, out_features: int, group_size: int, *, bias: bool, dtype: torch.dtype,
                 device=None, layout: str | None = None, has_perm: bool = False):
        super().__init__()
        if in_features % group_size:
            raise ValueError(f"Int4Linear: group_size {group_size} does not divide in_features {in_features}")
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.out_dtype = dtype
        device = torch.device(device or "cpu")
        # an automatic layout follows the device: .to()/.cuda() repack for the new device's kernel
        self._layout_auto = layout is None
        self.layout = layout_for(device, in_features, out_features, group_size) if layout is None else layout
        if self.layout not in LAYOUTS:
            raise ValueError(f"Int4Linear: unknown layout {self.layout!r}; known: {', '.join(LAYOUTS)}")
        if self.layout not in ("plain", *A8_LAYOUTS) and (out_features % 16 or group_size not in KERNEL_GROUP_SIZES):
            self.layout = "plain"
        reason = LAYOUTS[self.layout].fits(out_features, in_features, group_size)
        if reason is not None:
            raise ValueError(f"Int4Linear: {reason}")
        self._empty_buffers(device)
        self.register_buffer("in_perm", torch.arange(in_features, device=device) if has_perm else None)
        self.register_buffer("weight_dense", None, persistent=False)  # see enable_dense
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None

    # -- construction -------------------------------------------------------------------------------
    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *, group_size: int,
                   bias: torch.Tensor | None = None, in_perm: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float32, layout: str | None = None) -> Int4Linear:
        """Build from codes computed elsewhere.

        Args:
            codes: ``[out, in]`` integers 0..15 (in the stored column order: after ``in_perm``).
            scales: ``[out, in // group_size]`` float.
            zeros: ``[out, in // group_size]`` zero points (integers 0..15 for GPTQ/AWQ; any float allowed).
            group_size: input channels per group.
            bias: ``[out]`` or None.
            in_perm: optional ``[in]`` permutation: the layer computes ``x[..., in_perm] @ W.T``.
            dtype: the model's floating-point dtype (of outputs and bias).
            layout: force a layout (default: the fastest for ``codes.device``).
        """
        out_f, in_f = codes.shape
        new = cls(in_f, out_f, group_size, bias=bias is not None, dtype=dtype, device=codes.device, layout=layout,
                  has_perm=in_perm is not None)
        new._set_portable(None, scales.float(), zeros.float(), codes=codes)
        if in_perm is not None:
            new.in_perm.copy_(in_perm)
        if bias is not None:
            new.bias.data.copy_(bias.detach())
        return new

    @classmethod
    def from_packed(cls, layout: str, tensors: dict[str, torch.Tensor], *, in_features: int, out_features: int,
                    group_size: int, dtype: torch.dtype = torch.float32) -> Int4Linear:
        """Build from a kernel layout's own buffers computed elsewhere (a GGUF file's blocks transcoded into the
        ``a8`` layout at load: :func:`infopt.quantize.community.gguf_blocks.a8_int4`), without a pass through the
        portable codes. ``tensors`` must be exactly the layout's buffers, in its shapes and dtypes; no bias."""
        new = cls(in_features, out_features, group_size, bias=False, dtype=dtype, device="meta", layout=layout)
        if new.layout != layout:
            raise ValueError(f"Int4Linear.from_packed: the {layout!r} layout does not take a {in_features} -> "
                             f"{out_features} layer with group_size {group_size}")
        want = LAYOUTS[layout].empty(out_features, in_features, group_size, "meta")
        if set(tensors) != set(want):
            raise ValueError(f"Int4Linear.from_packed: the {layout!r} layout's buffers are {sorted(want)}, got "
                             f"{sorted(tensors)}")
        for name, t in tensors.items():
            if t.shape != want[name].shape or t.dtype != want[name].dtype:
                raise ValueError(f"Int4Linear.from_packed: {name} must be {want[name].dtype} "
                                 f"{tuple(want[name].shape)}, got {t.dtype} {tuple(t.shape)}")
            setattr(new, name, t)
        return new

    @classmethod
    def from_float(cls, module: nn.Module, *, group_size: int = 128, symmetric: bool = False, conv1d: bool = False,
                   weight: torch.Tensor | None = None, zero_point: str = "float", layout: str | None = None
                   ) -> Int4Linear:
        """Round-to-nearest from an ``nn.Linear`` (or ``Conv1D`` with ``conv1d=True``); ``weight`` overrides
        the module's ``[out, in]`` weight (e.g. a tied embedding)."""
        w = weight if weight is not None else module.weight.detach()
        if conv1d and weight is None:
            w = w.t()
        codes, scales, zeros = quantize_int4_grouped(w, group_size, symmetric, zero_point)
        bias = getattr(module, "bias", None)
        return cls.from_codes(codes, scales, zeros, group_size=group_size, bias=bias, dtype=w.dtype, layout=layout)

    # -- layouts ------------------------------------------------------------------------------------
    def _empty_buffers(self, device: torch.device) -> None:
        """(Re)register this layout's weight buffers, empty, on ``device``; drop the other layouts'."""
        for name in BUFFERS:
            self._buffers.pop(name, None)
        for name, t in LAYOUTS[self.layout].empty(self.out_features, self.in_features, self.group_size, device).items():
            self.register_buffer(name, t)

    def _storage_device(self) -> torch.device:
        return self._buffers[LAYOUTS[self.layout].storage].device

    def _set_portable(self, qweight: torch.Tensor | None, scales: torch.Tensor, zeros: torch.Tensor, *,
                      codes: torch.Tensor | None = None) -> None:
        # qweight (packed) or codes [out, in] (unpacked, which spares a kernel layout a pack/unpack round trip)
        device = (qweight if qweight is not None else codes).device
        if self._layout_auto:
            want = layout_for(device, self.in_features, self.out_features, self.group_size)
            if want != self.layout:
                self.layout = want
                self._empty_buffers(device)
        for name, t in LAYOUTS[self.layout].pack(self, qweight, scales, zeros, codes).items():
            setattr(self, name, t)

    def _apply(self, fn, recurse=True):
        # .to()/.cuda()/.cpu(): the packed weight of one device's kernel means nothing to another's, so a layer
        # whose layout follows its device leaves in the portable layout and is repacked for the new device
        src = self._storage_device()
        if not self._layout_auto or src.type == "meta":
            super()._apply(fn, recurse)
            return self
        dst = fn(torch.empty(0, device=src)).device
        if dst.type == "meta" or layout_for(dst, self.in_features, self.out_features, self.group_size) == self.layout:
            super()._apply(fn, recurse)
            return self
        q, s, z = self._portable()
        super()._apply(fn, recurse)
        self._set_portable(q.to(dst), s.to(dst), z.to(dst))
        return self

    def _portable(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(qweight, scales, zeros)`` in the portable layout (recovered exactly from a kernel layout)."""
        return LAYOUTS[self.layout].unpack(self)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        q, s, z = self._portable()
        destination[prefix + "qweight"] = q
        destination[prefix + "scales"] = s
        destination[prefix + "zeros"] = z
        if self.in_perm is not None:
            destination[prefix + "in_perm"] = self.in_perm
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        names = list(_PORTABLE) + (["in_perm"] if self.in_perm is not None else []) + (
            ["bias"] if self.bias is not None else [])
        got = {}
        for n in names:
            key = prefix + n
            if key in state_dict:
                got[n] = state_dict[key]
            elif strict:
                missing_keys.append(key)
        if strict:
            for key in state_dict:
                if key.startswith(prefix) and "." not in key[len(prefix):] and key[len(prefix):] not in names:
                    unexpected_keys.append(key)
        if all(n in got for n in _PORTABLE):
            q, s, z = got["qweight"], got["scales"], got["zeros"]
            want = (self.out_features, self.in_features // 2)
            if tuple(q.shape) != want:
                error_msgs.append(f"{prefix}qweight: shape {tuple(q.shape)} != {want}")
                return
            dev = self._storage_device()
            self._set_portable(q.to(dev), s.to(dev), z.to(dev))
            if self.weight_dense is not None:  # the prompt copy follows the loaded codes
                self.enable_dense()
        with torch.no_grad():
            if "in_perm" in got:
                self.in_perm.copy_(got["in_perm"])
            if "bias" in got:
                self.bias.copy_(got["bias"])

    # -- compute ------------------------------------------------------------------------------------
    def dequantize(self) -> torch.Tensor:
        """The fp32 weight ``[out, in]`` in the layer's input order (``in_perm`` undone)."""
        q, s, z = self._portable()
        w = dequantize(unpack_int4(q), (1, self.group_size), s, z)  # [out, in]
        if self.in_perm is not None:
            out = torch.empty_like(w)
            out[:, self.in_perm] = w
            w = out
        return w

    def enable_dense(self) -> None:
        """Keep the dequantized weight for calls of :data:`DENSE_MIN_ROWS` rows or more: in bf16 on CPUs with native
        bf16 GEMMs (:func:`~infopt.core.availability.fast_bf16_gemm`), else in the layer's dtype (there a bf16 GEMM
        is emulated, slower than the int4 kernel: :data:`DENSE_FP32_MIN_ROWS`). An ``a8`` layer keeps no copy on such CPUs: its integer
        kernel beats an fp32 GEMM at every row count measured."""
        fast = _FAST_BF16[0] or self._storage_device().type != "cpu"
        if not fast and self.layout in A8_LAYOUTS:
            self.weight_dense = None
            return
        dtype = torch.bfloat16 if fast else self.out_dtype
        self.weight_dense = self.dequantize().to(dtype).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        rows = x.numel() // self.in_features
        wd = self.weight_dense
        dense = wd is not None and rows >= (
            A8_DENSE_MIN_ROWS if self.layout in A8_LAYOUTS else DENSE_MIN_ROWS if wd.dtype == torch.bfloat16
            else DENSE_FP32_MIN_ROWS)
        if self.in_perm is not None and not dense:  # the dense copy is in the layer's input order already
            x = x.index_select(-1, self.in_perm)
        if dense:
            kernel = "dense"
            y = F.linear(x.to(wd.dtype), wd).to(x.dtype)
        else:
            kernel, y = LAYOUTS[self.layout].matmul(self, x, rows, _FAST_BF16[0])
        if not torch.compiler.is_compiling():  # a count read while tracing would make dynamo guard on it
            _CALLS[kernel] += 1
        if self.bias is not None:
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"bias={self.bias is not None}, layout={self.layout}")


@register_quantizer(Int4WeightOnly)
def _make(module: nn.Module, config: Int4WeightOnly, conv1d: bool) -> Int4Linear:
    layout = "a8" if a8.resolve(config.activations, module.weight.device) == "int8" else None
    if layout is None and config.cuda_kernel == "gemv":
        layout = "gemv"
    if layout == "a8" and config.symmetric:  # symmetric codes: their scales alone, in fp16 (a8_sym)
        layout = "a8_sym"
    layer = Int4Linear.from_float(module, group_size=config.group_size, symmetric=config.symmetric, conv1d=conv1d,
                                  zero_point=config.zero_point, layout=layout)
    if config.dense_prefill:
        layer.enable_dense()
    return layer


@register_experts_quantizer(Int4WeightOnly)
def _make_experts(experts: nn.Module, config: Int4WeightOnly) -> QuantizedExperts:
    return QuantizedExperts.from_experts(experts, lambda w: _make(w, config, False))
