"""W8A8 linear layer: int8 per-output-channel weights x int8 per-token dynamic activations, int32 accumulation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import a8
from .int8 import quantize_int8_per_channel
from .primitives import KeepsFormat, dequantize

__all__ = ["W8A8Linear", "quantize_per_token", "int_mm_supported", "fused_applies", "w8a8_steps", "KERNELS"]

KERNELS: tuple[str, ...] = ("auto", "int_mm", "float")
"""Values of :attr:`W8A8Linear.kernel`: ``auto`` picks ``int_mm`` where :func:`int_mm_supported` says so."""


def _cpu_int_mm_probe() -> bool:
    # torch._int_mm on CPU runs oneDNN's VNNI kernel with AVX-512; without it a scalar loop that is slower than
    # an fp32 matmul, and before torch 2.6 it could overflow int32 on CPUs without VNNI (pytorch#136942).
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return version >= (2, 6) and torch.backends.cpu.get_cpu_capability().startswith("AVX512")


_CPU_INT_MM_FAST = _cpu_int_mm_probe()
"""Read once at import: a compiled step reads the constant (dynamo cannot trace ``get_cpu_capability``, which
returns a string, and every compiled W8A8 step fell back to eager on it)."""


def fused_applies(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``torch.ops.infopt.w8a8_linear`` (the C++ kernel: per-token quantization, ``torch._int_mm`` and the
    rescale in one call) serves ``x [m, k]``: fp32 or bf16 on the CPU, a bias in the same dtype, the kernel built."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if bias is not None and bias.dtype != x.dtype:
        return False
    return a8.available()  # loaded by W8A8Linear.__init__ on CPUs where it applies: no lock for dynamo to trace


def w8a8_steps(x: torch.Tensor, weight_int8: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
               dtype: torch.dtype, int_mm: bool) -> torch.Tensor:
    """:class:`W8A8Linear`'s product in torch operations: ``x [m, in]`` quantized per token, times the int8 weight
    (``torch._int_mm`` when ``int_mm``, else the same integers in an fp32 matmul), rescaled, cast to ``dtype``, plus
    the bias. The oracle of the C++ kernel, which gives the same bits."""
    xq, a_scale = quantize_per_token(x)  # [m, in] int8, [m, 1] fp32
    m = xq.shape[0]
    if int_mm:
        if xq.device.type == "cuda" and m <= 16:  # cuBLAS int8 wants m > 16: pad with zero rows
            xq = torch.cat([xq, xq.new_zeros(17 - m, xq.shape[1])])
        acc = torch._int_mm(xq, weight_int8.t())[:m]  # [m, out] int32, exact
    else:
        acc = F.linear(xq.float(), weight_int8.float())  # [m, out], the same integers summed in fp32
    y = acc.float().mul_(a_scale).mul_(weight_scale).to(dtype)
    return y if bias is None else y + bias


def int_mm_supported(device: torch.device, m: int, k: int, n: int) -> tuple[bool, str]:
    """Whether ``torch._int_mm`` (int8 ``[m, k]`` x int8 ``[k, n]`` -> int32) can serve this product, and why.

    On CPU (torch >= 2.6 with AVX-512) it takes any shape, strided views included, m = 1 too.
    On CUDA, cuBLAS needs ``k`` and ``n`` multiples of 8 and ``m > 16``; :class:`W8A8Linear` pads
    ``m <= 16`` rows with zeros to 17, so only the ``k``/``n`` rule remains.

    Args:
        device: where the operands live.
        m, k, n: the product's shape (tokens, in features, out features).

    Returns:
        ``(ok, reason)``; ``reason`` says why not when ``ok`` is False.

    Example:
        >>> int_mm_supported(torch.device("meta"), 4, 64, 64)
        (False, 'no int8 matmul kernel on meta')
    """
    if not hasattr(torch, "_int_mm"):
        return False, f"torch {torch.__version__} has no torch._int_mm"
    if device.type == "cpu":
        if not _CPU_INT_MM_FAST:
            return False, "torch._int_mm on this CPU is a scalar loop (no AVX-512) or torch < 2.6"
        return True, ""
    if device.type == "cuda":
        if k % 8 or n % 8:
            return False, f"cuBLAS int8 matmul needs in/out features that are multiples of 8, got {k}x{n}"
        return True, ""
    return False, f"no int8 matmul kernel on {device.type}"


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric dynamic int8 quantization, one scale per row (token).

    Args:
        x: ``[m, k]`` floating point.

    Returns:
        ``(q, scale)``: ``q`` int8 ``[m, k]`` in -127..127, ``scale`` fp32 ``[m, 1]`` with ``x ~= q * scale``
        (``absmax / 127``, an all-zero row's absmax taken as 1e-12: the formula of
        :func:`~infopt.quantize.formats.int8.quantize_int8_per_channel`).

    Example:
        >>> q, s = quantize_per_token(torch.tensor([[1.0, -2.0], [0.0, 0.0]]))
        >>> q.tolist(), s.flatten().tolist()[1] > 0
        ([[64, -127], [0, 0]], True)
    """
    # the per-row case of primitives.choose_qparams / quantize written out: this runs on every call of every
    # layer, and the general block-shape path costs ~6 us more per call (tests assert both give the same bits)
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12).div_(127.0)  # [m, 1]
    return (x32 / scale).round_().clamp_(-127, 127).to(torch.int8), scale


class W8A8Linear(KeepsFormat):
    """A linear layer computing int8 x int8 -> int32, rescaled by activation scale x weight scale.

    Weights are quantized once, symmetric per output channel. Activations are quantized on every
    call, symmetric per token (``absmax / 127``), so no activation range is stored. The product runs
    in ``torch._int_mm`` where :func:`int_mm_supported` allows it, otherwise as a float matmul of the
    same integer values (identical up to fp32 summation order). :attr:`last_kernel` says which path
    the last call took (``"int_mm"`` or ``"float"``); set :attr:`kernel` to force one.

    Buffers (saved in ``state_dict``): ``weight_int8`` int8 ``[out, in]``, ``weight_scale`` fp32 ``[out]``,
    and, when built with ``input_scale=True``, ``input_scale`` fp32 ``[in]``: a SmoothQuant ``1/s`` the
    input is multiplied by before quantization, for layers whose smoothing could not be folded into
    the layer before them. ``bias`` stays a floating-point parameter.

    Args:
        in_features, out_features: shapes.
        bias: whether there is a bias.
        dtype: the dtype of the bias and of the output (the model's dtype).
        input_scale: reserve the ``input_scale`` buffer.
        device: where to allocate.

    Example:
        >>> lin = nn.Linear(64, 32)
        >>> q = W8A8Linear.from_float(lin)
        >>> x = torch.randn(5, 64)
        >>> y = q(x)
        >>> y.shape, q.last_kernel in ("int_mm", "float")
        (torch.Size([5, 32]), True)
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype = torch.float32,
                 input_scale: bool = False, device=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        if input_scale:
            self.register_buffer("input_scale", torch.ones(in_features, dtype=torch.float32, device=device))
        else:
            self.input_scale = None
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        self.kernel = "auto"
        self.last_kernel: str | None = None
        if _CPU_INT_MM_FAST and torch.device(device or "cpu").type == "cpu":
            a8.available()  # build or load the C++ kernels now, outside any compiled region

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    input_scale: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> W8A8Linear:
        """Build from a float weight ``[out, in]`` (already smoothed, if smoothing applies).

        Args:
            weight: ``[out, in]`` floating point.
            bias: ``[out]`` or None.
            input_scale: ``[in]`` multiplier applied to the input at run time, or None.
            dtype: bias/output dtype (default: the weight's).

        Returns:
            The quantized layer, on the weight's device.
        """
        out_f, in_f = weight.shape
        new = cls(in_f, out_f, bias=bias is not None, dtype=dtype or weight.dtype, input_scale=input_scale is not None,
                  device=weight.device)
        q, s = quantize_int8_per_channel(weight)
        new.weight_int8.copy_(q)
        new.weight_scale.copy_(s)
        if bias is not None:
            new.bias.data.copy_(bias.detach())
        if input_scale is not None:
            new.input_scale.copy_(input_scale.detach().float())
        return new

    @classmethod
    def from_float(cls, module: nn.Module, *, conv1d: bool = False, smooth: torch.Tensor | None = None) -> W8A8Linear:
        """Build from an ``nn.Linear`` (or a transformers ``Conv1D`` with ``conv1d=True``).

        Args:
            module: the float layer.
            conv1d: the layer stores its weight ``[in, out]``.
            smooth: SmoothQuant factors ``s`` ``[in]``: the weight is stored as ``W * s`` and the
                input multiplied by ``1/s`` at run time (the product is unchanged before rounding).

        Returns:
            The quantized layer.
        """
        w = module.weight.detach()
        if conv1d:  # Conv1D stores [in, out]
            w = w.t()
        w32 = w.float()
        if smooth is not None:
            w32 = w32 * smooth.float()[None, :]
        bias = module.bias.detach() if module.bias is not None else None
        return cls.from_weight(w32, bias, input_scale=None if smooth is None else 1.0 / smooth.float(), dtype=w.dtype)

    def dequantize(self) -> torch.Tensor:
        """The float weight ``[out, in]`` these int8 values stand for (``input_scale`` not applied)."""
        return dequantize(self.weight_int8, (1, self.in_features), self.weight_scale)

    def _use_int_mm(self, x2: torch.Tensor) -> bool:
        if self.kernel == "float":
            return False
        if self.kernel not in KERNELS:
            raise ValueError(f"W8A8Linear.kernel={self.kernel!r}; allowed: {', '.join(KERNELS)}")
        ok, reason = int_mm_supported(x2.device, x2.shape[0], self.in_features, self.out_features)
        if self.kernel == "int_mm" and not ok:
            raise RuntimeError(f"W8A8Linear.kernel='int_mm' cannot run here: {reason}")
        return ok

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        x2 = x.reshape(-1, self.in_features)
        if self.input_scale is not None:
            x2 = x2.float() * self.input_scale
        int_mm = self._use_int_mm(x2)
        if int_mm and x2.dtype == x.dtype and fused_applies(x2, self.bias):
            # one C++ call: quantize per token, torch._int_mm, rescale, bias: the bits of w8a8_steps
            y = torch.ops.infopt.w8a8_linear(x2, self.weight_int8, self.weight_scale, self.bias)
        else:
            y = w8a8_steps(x2, self.weight_int8, self.weight_scale, self.bias, x.dtype, int_mm)
        if not torch.compiler.is_compiling():
            self.last_kernel = "int_mm" if int_mm else "float"
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_scale={self.input_scale is not None}, kernel={self.kernel}")
