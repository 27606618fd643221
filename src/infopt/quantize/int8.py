"""Int8 weight-only quantization: per-output-channel symmetric round-to-nearest, int8 matmul kernel on CPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..core.step import StepConfig, bad_field, register_step

__all__ = ["Int8WeightOnly", "Int8Linear", "quantize_int8_per_channel"]

_COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "auto": None}


@register_step
@dataclass(frozen=True)
class Int8WeightOnly(StepConfig):
    """Weights stored as int8 with one fp32 scale per output channel; activations stay floating point.

    Args:
        compute_dtype: dtype of the matmul. ``"auto"`` uses bfloat16 activations with the fused
            int8 kernel (``torch._weight_int8pack_mm``) on CPU, which is faster than an fp32 matmul
            on the same weights, and the model's dtype elsewhere (dequantize-then-matmul).
            ``"float32"`` keeps fp32 activations (dequantizes each call: exact but slower).
        include_lm_head: also quantize the output head (it is often tied to the embedding, in which
            case it is left alone whatever this says).

    Raises:
        RecipeError: unknown compute_dtype.

    Example:
        >>> from infopt.models import tiny_model
        >>> from infopt.quantize import quantize_
        >>> m = quantize_(tiny_model(), Int8WeightOnly())
        >>> type(m.model.layers[0].mlp.up_proj).__name__
        'Int8Linear'
    """

    stage: ClassVar[str] = "quantize"
    kind: ClassVar[str] = "int8"
    discriminator: ClassVar[str] = "method"
    compute_dtype: str = "auto"
    include_lm_head: bool = False

    def __post_init__(self):
        if self.compute_dtype not in _COMPUTE_DTYPES:
            raise bad_field(self, "compute_dtype", self.compute_dtype, ", ".join(_COMPUTE_DTYPES))
        if not isinstance(self.include_lm_head, bool):
            raise bad_field(self, "include_lm_head", self.include_lm_head, "true or false")


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantization.

    Args:
        w: ``[out, in]`` floating-point weight.

    Returns:
        ``(q, scale)``: ``q`` int8 ``[out, in]``, ``scale`` fp32 ``[out]`` with ``w ~= q * scale[:, None]``.
    """
    w32 = w.detach().float()
    amax = w32.abs().amax(dim=1).clamp(min=1e-12)  # [out]
    scale = amax / 127.0
    q = torch.round(w32 / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _int8pack_available(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(torch, "_weight_int8pack_mm")


class Int8Linear(nn.Module):
    """A linear layer with int8 weights ``[out, in]`` and per-channel scales.

    Buffers (saved in ``state_dict``): ``weight_int8`` int8 ``[out, in]``, ``weight_scale`` fp32 ``[out]``;
    ``bias`` stays a floating-point parameter.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype,
                 compute_dtype: torch.dtype | None, device=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.out_dtype = dtype
        self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        self.compute_dtype = compute_dtype
        self._scale_cache: dict[torch.dtype, torch.Tensor] = {}

    @classmethod
    def from_float(cls, module: nn.Module, *, compute_dtype: str = "auto", conv1d: bool = False) -> Int8Linear:
        """Build from an ``nn.Linear`` (or a transformers ``Conv1D`` with ``conv1d=True``)."""
        w = module.weight.detach()
        if conv1d:  # Conv1D stores [in, out]
            w = w.t()
        out_f, in_f = w.shape
        cd = _COMPUTE_DTYPES[compute_dtype]
        if cd is None:
            cd = torch.bfloat16 if _int8pack_available(w.device) else None
        new = cls(in_f, out_f, bias=module.bias is not None, dtype=w.dtype, compute_dtype=cd, device=w.device)
        q, s = quantize_int8_per_channel(w)
        new.weight_int8.copy_(q)
        new.weight_scale.copy_(s)
        if module.bias is not None:
            new.bias.data.copy_(module.bias.detach())
        return new

    def dequantize(self) -> torch.Tensor:
        """The float weight ``[out, in]`` these int8 values stand for."""
        return self.weight_int8.float() * self.weight_scale[:, None]

    def _scale(self, dtype: torch.dtype) -> torch.Tensor:
        s = self._scale_cache.get(dtype)
        if s is None or s.device != self.weight_scale.device:
            s = self.weight_scale.to(dtype)
            self._scale_cache[dtype] = s
        return s

    def _load_from_state_dict(self, *args, **kwargs):
        self._scale_cache.clear()
        return super()._load_from_state_dict(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        cd = self.compute_dtype
        if cd is not None and _int8pack_available(x.device) and cd in (torch.bfloat16, torch.float16):
            x2 = x.reshape(-1, self.in_features).to(cd).contiguous()
            y = torch._weight_int8pack_mm(x2, self.weight_int8, self._scale(cd))
            y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        else:
            wd = cd or x.dtype
            y = F.linear(x.to(wd), self.weight_int8.to(wd)) * self._scale(wd)
            y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"compute_dtype={self.compute_dtype}")
