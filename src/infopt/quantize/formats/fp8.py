"""FP8 (float8_e4m3fn) weights and dynamic fp8 activations multiplied by ``torch._scaled_mm`` on Ada/Hopper GPUs, or
FP8 weights alone (``activations="none"``: infopt's Triton matrix-vector kernel at up to eight rows).

The fp8 formulas here (:func:`quantize_fp8`, :func:`dequantize_fp8`) are also what the fp8 KV cache
(:class:`infopt.kvcache.Quantized` with ``dtype="fp8"``) stores its keys and values with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ...core.errors import IncompatibleModelError
from ...core.step import StepConfig, bad_field, register_step
from ...ops.triton_gemv import GEMV_MAX_ROWS, w8_gemv
from ..api import quantize_targets, register_quantizer
from .primitives import KeepsFormat, choose_qparams, dequantize, quantize

__all__ = ["FP8", "FP8Linear", "fp8_supported", "fp8_dtype", "quantize_fp8", "dequantize_fp8", "FP8_MAX",
           "GRANULARITIES", "KERNELS"]

FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value; a scale maps each row's (or the tensor's) absmax onto it."""

GRANULARITIES: tuple[str, ...] = ("row", "tensor")
"""Values of :attr:`FP8.granularity`: one scale per output row / input row, or one per tensor."""

ACTIVATIONS: tuple[str, ...] = ("dynamic", "none")
"""Values of :attr:`FP8.activations`: fp8 activations scaled per call, or activations left in the model's dtype."""

KERNELS: tuple[str, ...] = ("auto", "scaled_mm", "reference")
"""Values of :attr:`FP8Linear.kernel`: ``auto`` takes ``scaled_mm`` where :func:`fp8_supported` says so."""

MIN_TORCH = (2, 5)  # _scaled_mm returns one tensor and takes any number of rows from 2.5 on


def fp8_dtype() -> torch.dtype | None:
    """``torch.float8_e4m3fn``, or None on a torch without float8 dtypes."""
    return getattr(torch, "float8_e4m3fn", None)


def _torch_version() -> tuple[int, int]:
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def fp8_supported(device: torch.device | str) -> tuple[bool, str]:
    """Whether ``torch._scaled_mm`` can multiply fp8 matrices on ``device``, and why not.

    Needs torch >= 2.5 with ``float8_e4m3fn`` and ``torch._scaled_mm``, and a CUDA device of compute
    capability 8.9 (Ada) or higher (Hopper 9.0, Blackwell). CPU, MPS, ROCm and older GPUs are refused.
    Nothing is cached, and on CPU no CUDA call is made.

    Args:
        device: where the model lives.

    Returns:
        ``(ok, reason)``; ``reason`` names the device or capability when ``ok`` is False.

    Example:
        >>> fp8_supported("cpu")[0]
        False
    """
    device = torch.device(device)
    if fp8_dtype() is None or not hasattr(torch, "_scaled_mm"):
        return False, f"torch {torch.__version__} has no float8_e4m3fn / torch._scaled_mm"
    if _torch_version() < MIN_TORCH:
        return False, f"torch {torch.__version__} is older than {MIN_TORCH[0]}.{MIN_TORCH[1]}"
    if device.type != "cuda":
        return False, f"no fp8 matmul kernel on {device.type} (torch._scaled_mm needs a CUDA GPU with compute " \
                      "capability >= 8.9)"
    if torch.version.hip is not None:
        return False, "ROCm GPUs use float8_e4m3fnuz on MI300; infopt's FP8 step supports CUDA only"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return False, f"{device} has compute capability {major}.{minor}; fp8 matmuls need 8.9 (Ada) or 9.0+ (Hopper)"
    return True, ""


def quantize_fp8(x: torch.Tensor, granularity: str = "row") -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric float8_e4m3fn quantization: ``x ~= codes * scale``.

    Args:
        x: ``[..., n]`` floating point.
        granularity: ``"row"``: one scale per row (the last dim is what a scale spans), shape
            ``[..., 1]``; ``"tensor"``: one scale, shape ``[1]``.

    Returns:
        ``(codes, scale)``: ``codes`` float8_e4m3fn shaped like ``x``; ``scale`` fp32, ``absmax / 448``
        (a zero row gets a tiny positive scale and zero codes).

    Example:
        >>> codes, scale = quantize_fp8(torch.tensor([[1.0, -448.0], [224.0, 14.0]]))
        >>> codes.dtype, scale.flatten().tolist()
        (torch.float8_e4m3fn, [1.0, 0.5])
        >>> dequantize_fp8(codes, scale).tolist()
        [[1.0, -448.0], [224.0, 14.0]]
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"quantize_fp8 granularity={granularity!r}; allowed: {', '.join(GRANULARITIES)}")
    x32 = x.float()
    # row: one block per row ([..., 1] scales); tensor: one block
    block = (*([1] * (x32.dim() - 1)), x32.shape[-1]) if granularity == "row" else tuple(x32.shape)
    scale, _ = choose_qparams(x32, block, qmin=-FP8_MAX, qmax=FP8_MAX, symmetric=True, min_range=1e-12)
    codes = quantize(x32, block, scale, qmin=-FP8_MAX, qmax=FP8_MAX, dtype=fp8_dtype())
    return codes, (scale if granularity == "row" else scale.reshape(1))


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: ``codes * scale`` as ``dtype`` (the product is taken in fp32).

    Args:
        codes: float8_e4m3fn ``[..., n]``.
        scale: ``[..., 1]`` (one per row) or ``[1]`` (one for the tensor).
        dtype: the result's dtype.

    Example:
        >>> dequantize_fp8(*quantize_fp8(torch.tensor([[2.0, -1.0]]))).tolist()
        [[2.0, -1.0]]
    """
    block = tuple(codes.shape) if scale.numel() == 1 else (*([1] * (codes.dim() - 1)), codes.shape[-1])
    return dequantize(codes, block, scale).to(dtype)


@register_step
@dataclass(frozen=True)
class FP8(StepConfig):
    """Weights stored as float8_e4m3fn with fp32 scales; activations quantized to fp8 on every call, and
    the product computed by ``torch._scaled_mm`` (fp32 accumulation) on CUDA GPUs of compute capability
    8.9+ (Ada, Hopper).

    Args:
        granularity: ``"row"`` (default): one scale per weight output row and per activation row (token);
            ``"tensor"``: one scale for the whole weight and one for each call's activations (coarser,
            any output dtype on every torch).
        activations: ``"dynamic"``: the activation scale is computed from each call's input (absmax),
            nothing calibrated or stored. ``"none"``: weight-only FP8: the activations stay in the model's dtype;
            up to eight rows (decode) are multiplied by infopt's Triton kernel reading the fp8 weight once
            (:func:`infopt.ops.triton_gemv.w8_gemv`), more rows by the weight dequantized for the call. More
            accurate than ``"dynamic"`` (only the weights are rounded). On an H200 (the fifth GPU lane run), at one
            row on an 8B Llama's layers, the kernel read at 35-50% of the copy bandwidth (``_scaled_mm``: 14-19%,
            cuBLAS bf16: 59-75%), and 8B batch-1 decode with it was 1.015x ``gpu-fast`` in bf16.
        include_lm_head: also quantize the output head. When it is tied to the input embedding, the head
            gets its own fp8 copy and the embedding keeps its weight.

    Raises:
        RecipeError: an unknown granularity or activations mode, a non-boolean include_lm_head.
        IncompatibleModelError (at validation, before the model is touched): the model is on a device
            without fp8 matmuls (CPU, a GPU below compute capability 8.9; see :func:`fp8_supported`),
            or a layer's in/out features are not multiples of 16.

    Example:
        >>> FP8().to_dict()
        {'quantize': {'method': 'fp8', 'granularity': 'row', 'activations': 'dynamic', 'include_lm_head': False}}
        >>> from infopt.models import tiny_model
        >>> from infopt.quantize import quantize_
        >>> quantize_(tiny_model(), FP8())  # on CPU
        Traceback (most recent call last):
        ...
        infopt.core.errors.IncompatibleModelError: quantize.FP8 cannot run on this model: no fp8 matmul kernel on cpu ...
    """

    stage: ClassVar[str] = "quantize"
    kind: ClassVar[str] = "fp8"
    discriminator: ClassVar[str] = "method"
    granularity: str = "row"
    activations: str = "dynamic"
    include_lm_head: bool = False

    def __post_init__(self):
        if self.granularity not in GRANULARITIES:
            raise bad_field(self, "granularity", self.granularity, ", ".join(GRANULARITIES))
        if self.activations not in ACTIVATIONS:
            raise bad_field(self, "activations", self.activations,
                            "dynamic (per-call activation scales) or none (weight-only; static calibrated scales are "
                            "not implemented)")
        if not isinstance(self.include_lm_head, bool):
            raise bad_field(self, "include_lm_head", self.include_lm_head, "true or false")

    def check(self, model, info, steps):
        ok, reason = fp8_supported(info.device)
        if not ok:
            raise IncompatibleModelError(
                f"quantize.FP8 cannot run on this model: {reason}. Use Int8WeightOnly or Int4WeightOnly "
                "(quantize method 'int8' / 'int4'), which run on CPU and any GPU, or move the model to an sm_89+ "
                "GPU (Ada, Hopper) before optimizing"
            )
        for t in quantize_targets(model, self):
            out_f, in_f = t.weight.shape
            if in_f % 16 or out_f % 16:
                raise IncompatibleModelError(
                    f"quantize.FP8: {t.fqn} is {in_f} -> {out_f} features; torch._scaled_mm needs both to be "
                    "multiples of 16. Exclude it with quantize_(..., exclude=[...]) or use Int8WeightOnly"
                )
        return []


def _out_dtype(x_dtype: torch.dtype, granularity: str) -> torch.dtype:
    # some torch releases' rowwise kernel (CUTLASS) writes bf16 only; tensorwise (cuBLAS) takes fp16 too.
    # A float32 model gets a bf16 product cast up: the fp8 operands dominate the error anyway.
    if x_dtype == torch.bfloat16 or (x_dtype == torch.float16 and granularity == "tensor"):
        return x_dtype
    return torch.bfloat16


class FP8Linear(KeepsFormat):
    """A linear layer with float8_e4m3fn weights, multiplied with fp8-quantized activations.

    Each call quantizes the input with :func:`quantize_fp8` at the layer's granularity and runs
    ``torch._scaled_mm(x_fp8, weight_fp8.t(), scale_a, scale_b)`` (fp32 accumulation, bf16 output, or
    the input's fp16 with tensor scales), then casts to the input's dtype and adds the bias.
    :meth:`reference_forward` computes the same product in pure torch (dequantized operands, fp32
    matmul): it runs anywhere, and is what tests compare the kernel against. :attr:`kernel` picks the
    path (``"auto"``: ``scaled_mm`` where :func:`fp8_supported` allows it, the reference elsewhere);
    :attr:`last_kernel` says which one the last call took.

    Buffers (saved in ``state_dict``): ``weight_fp8`` float8_e4m3fn ``[out, in]``, ``weight_scale`` fp32
    ``[out]`` (row) or ``[1]`` (tensor); ``bias`` stays a floating-point parameter.

    Args:
        in_features, out_features: shapes (multiples of 16 for ``torch._scaled_mm``).
        bias: whether there is a bias.
        dtype: the dtype of the bias (the model's dtype).
        granularity: ``"row"`` or ``"tensor"``, for weights and activations alike (``torch._scaled_mm``
            takes row x row or tensor x tensor scales).
        activations: ``"dynamic"`` (fp8 activations, ``torch._scaled_mm``) or ``"none"`` (weight-only: the Triton
            GEMV kernel at up to :data:`~infopt.ops.triton_gemv.GEMV_MAX_ROWS` rows, ``last_kernel``
            ``"gemv"``; the dequantized weight above, ``"dequantized"``).
        device: where to allocate.

    Example:
        >>> lin = nn.Linear(64, 32)
        >>> q = FP8Linear.from_float(lin)
        >>> y = q(torch.randn(5, 64))  # CPU: the reference path
        >>> y.shape, q.last_kernel, q.weight_fp8.dtype
        (torch.Size([5, 32]), 'reference', torch.float8_e4m3fn)
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype = torch.float32,
                 granularity: str = "row", activations: str = "dynamic", device=None):
        super().__init__()
        if granularity not in GRANULARITIES:
            raise ValueError(f"FP8Linear granularity={granularity!r}; allowed: {', '.join(GRANULARITIES)}")
        if activations not in ACTIVATIONS:
            raise ValueError(f"FP8Linear activations={activations!r}; allowed: {', '.join(ACTIVATIONS)}")
        self.activations = activations
        if fp8_dtype() is None:
            raise RuntimeError(f"FP8Linear needs torch.float8_e4m3fn, which torch {torch.__version__} lacks")
        self.in_features = in_features
        self.out_features = out_features
        self.granularity = granularity
        self.register_buffer("weight_fp8", torch.zeros(out_features, in_features, dtype=fp8_dtype(), device=device))
        scale_shape = (out_features,) if granularity == "row" else (1,)
        self.register_buffer("weight_scale", torch.ones(scale_shape, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        self.kernel = "auto"
        self.last_kernel: str | None = None
        self._auto: dict[torch.device, str] = {}

    @classmethod
    def from_float(cls, module: nn.Module, *, granularity: str = "row", conv1d: bool = False,
                   activations: str = "dynamic") -> FP8Linear:
        """Build from an ``nn.Linear`` (or a transformers ``Conv1D`` with ``conv1d=True``).

        Args:
            module: the float layer.
            granularity: ``"row"`` or ``"tensor"``.
            conv1d: the layer stores its weight ``[in, out]``.
            activations: ``"dynamic"`` or ``"none"`` (weight-only).

        Returns:
            The quantized layer, on the weight's device.
        """
        w = module.weight.detach()
        if conv1d:  # Conv1D stores [in, out]
            w = w.t()
        out_f, in_f = w.shape
        bias = getattr(module, "bias", None)
        new = cls(in_f, out_f, bias=bias is not None, dtype=w.dtype, granularity=granularity, activations=activations,
                  device=w.device)
        codes, scale = quantize_fp8(w, granularity)  # [out, in], [out, 1] or [1]
        new.weight_fp8.copy_(codes)
        new.weight_scale.copy_(scale.reshape(new.weight_scale.shape))
        if bias is not None:
            new.bias.data.copy_(bias.detach())
        return new

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight ``[out, in]`` these fp8 values stand for."""
        s = self.weight_scale[:, None] if self.granularity == "row" else self.weight_scale
        return dequantize_fp8(self.weight_fp8, s)

    def _load_from_state_dict(self, *args, **kwargs):
        self._auto.clear()
        return super()._load_from_state_dict(*args, **kwargs)

    def _use_scaled_mm(self, device: torch.device) -> bool:
        if self.kernel == "reference":
            return False
        if self.kernel == "scaled_mm":
            return True  # forced: torch._scaled_mm raises where it cannot run
        if self.kernel != "auto":
            raise ValueError(f"FP8Linear.kernel={self.kernel!r}; allowed: {', '.join(KERNELS)}")
        k = self._auto.get(device)
        if k is None:
            k = self._auto[device] = "scaled_mm" if fp8_supported(device)[0] else "reference"
        return k == "scaled_mm"

    def _matmul_reference(self, x2: torch.Tensor) -> torch.Tensor:
        # x2: [m, in] -> [m, out] fp32: the kernel's operands dequantized, multiplied in fp32
        xq, xs = quantize_fp8(x2, self.granularity)
        return F.linear(dequantize_fp8(xq, xs), self.dequantize())

    def _matmul_scaled_mm(self, x2: torch.Tensor) -> torch.Tensor:
        # x2: [m, in] -> [m, out] in _out_dtype
        xq, xs = quantize_fp8(x2, self.granularity)  # [m, in] fp8, [m, 1] or [1] fp32
        if self.granularity == "row":
            scale_a, scale_b = xs, self.weight_scale.view(1, -1)  # [m, 1], [1, out]
        else:
            scale_a, scale_b = xs.reshape(()), self.weight_scale.reshape(())
        # the second operand must be column-major: the transposed view of the row-major [out, in] weight
        y = torch._scaled_mm(xq, self.weight_fp8.t(), scale_a=scale_a, scale_b=scale_b,
                             out_dtype=_out_dtype(x2.dtype, self.granularity))
        return y[0] if isinstance(y, tuple) else y  # torch < 2.4 returned (out, amax)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output computed in pure torch: the input quantized exactly as :meth:`forward` does,
        both operands dequantized, an fp32 matmul. Runs on any device; the oracle for the kernel.

        Args:
            x: ``[..., in]``.

        Returns:
            ``[..., out]`` in ``x``'s dtype.
        """
        x2 = x.reshape(-1, self.in_features)
        if self.activations == "none":
            return self._finish(F.linear(x2.float(), self.dequantize()), x)
        return self._finish(self._matmul_reference(x2), x)

    def _finish(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        x2 = x.reshape(-1, self.in_features)
        if self.activations == "none" and x2.shape[0] <= GEMV_MAX_ROWS and self.kernel != "reference":
            scale = self.weight_scale.expand(self.out_features)  # one per output row (a tensor scale repeated)
            y, kernel = w8_gemv(x2, self.weight_fp8, scale.contiguous()), "gemv"
        elif self.activations == "none" and x2.dtype in (torch.bfloat16, torch.float32):
            # the codes in the activations' dtype (every e4m3 value is exact in bf16), the scales on the product: one
            # pass over the weight, where dequantizing in fp32 and casting took three (measured on an H200: about 40 ms
            # per generate for an 8B model's prompt). (fp16 keeps the path below: the unscaled product can overflow.)
            # (the scale: one per output column, or one in all: [out] or [1] broadcasts over the product's columns)
            y, kernel = F.linear(x2, self.weight_fp8.to(x2.dtype)) * self.weight_scale.to(x2.dtype), "dequantized"
        elif self.activations == "none":
            y, kernel = F.linear(x2, self.dequantize().to(x2.dtype)), "dequantized"
        elif self._use_scaled_mm(x2.device):
            y, kernel = self._matmul_scaled_mm(x2), "scaled_mm"
        else:
            y, kernel = self._matmul_reference(x2), "reference"
        if not torch.compiler.is_compiling():
            self.last_kernel = kernel
        return self._finish(y, x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"granularity={self.granularity}, activations={self.activations}, kernel={self.kernel}")


@register_quantizer(FP8)
def _make(module: nn.Module, config: FP8, conv1d: bool) -> FP8Linear:
    return FP8Linear.from_float(module, granularity=config.granularity, conv1d=conv1d, activations=config.activations)
