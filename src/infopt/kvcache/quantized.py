"""Quantized KV cache (native torch), recent tokens exact: KIVI-style int8/int4 (keys per channel, values per token),
or float8_e4m3fn with one scale per token per head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..core.errors import IncompatibleModelError
from ..core.introspect import ModelInfo, context_length, inspect_model
from ..core.step import ApplyContext, StepConfig, bad_field, register_step, register_transform
from ..generate import set_part
from ..quantize.formats.fp8 import fp8_dtype
from ..quantize.formats.primitives import pack_int4, scale_dtype_for, unpack_int4
from .api import FreshCache, register_use, require_full_attention
from .quantized_cache import QuantizedKVCache, dequantize_groups, quantize_groups

__all__ = [
    "Quantized",
    "use_",
    "quantize_groups",
    "dequantize_groups",
    "pack_int4",
    "unpack_int4",
    "bytes_per_token",
    "DTYPES",
]
# quantize_groups / dequantize_groups live beside the cache that stores their codes (quantized_cache), pack_int4 /
# unpack_int4 in infopt.quantize.formats.primitives; this module named them first

AXES = ("channel", "token")
DTYPES = ("int", "fp8")
"""Values of :attr:`Quantized.dtype`: ``int`` (KIVI codes with scale + zero point) or ``fp8`` (float8_e4m3fn)."""
_INT_ONLY = ("group_size", "axis_key", "axis_value")  # fields dtype="fp8" does not use: left at their defaults


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


@register_step
@dataclass(frozen=True)
class Quantized(StepConfig):
    """A KV cache stored as int8 or int4 with a group-wise scale and zero-point (KIVI), or as fp8, most recent
    tokens exact.

    Keys are quantized per channel (each channel's scale and zero-point span ``group_size`` tokens),
    values per token (each token's span ``group_size`` channels of ``head_dim``), asymmetric min/max.
    The newest tokens stay in full precision in a residual window; when it holds ``residual_length``
    tokens it is quantized and appended to the quantized store. Attention reads dequantized K/V
    (quantized part + residual), so any attention backend that takes K/V tensors can read it (eager and
    sdpa are tested); the price, without a fused kernel, is rebuilding one layer's K/V at each step.
    int4 values are packed two per byte.

    With ``dtype="fp8"`` keys and values are stored as float8_e4m3fn with one fp32 scale per token per
    KV head (symmetric, ``absmax / 448`` over ``head_dim``), on any device torch casts float8 on
    (CPU included); ``group_size`` and the axes do not apply (leave them at their defaults).

    Args:
        bits: 8 or 4 (8 with ``dtype="fp8"``).
        group_size: tokens per key group (channel axis) / channels per value group (token axis);
            a group of channels spans at most one head: from ``head_dim`` up, each token's head is one
            group, and a smaller ``group_size`` must divide ``head_dim``.
        residual_length: full-precision window, a multiple of ``group_size`` (with ``dtype="fp8"``:
            any count, 0 storing every token as fp8 at once). Greedy output is token-identical to
            plain ``generate`` while prompt + new tokens <= ``residual_length``.
        axis_key: ``channel`` (KIVI: per-channel key outliers) or ``token``.
        axis_value: ``token`` (KIVI) or ``channel``.
        dtype: ``"int"`` (default; KIVI codes) or ``"fp8"``. Written in a recipe only when not ``"int"``.

    Raises:
        RecipeError: a field out of range (bits not 8/4, non-positive sizes, ``residual_length`` not a
            multiple of ``group_size``, an unknown axis or dtype; with ``dtype="fp8"``: bits 4, or a
            ``group_size``/axis other than the default).
        IncompatibleModelError (at validation): ``group_size`` below ``head_dim`` and not dividing it on a
            per-token axis; ``dtype="fp8"`` on a torch without float8 dtypes.

    Sliding-window layers (Gemma 3) keep every token like the others, quantized past the residual window; the
    model's mask keeps each query to its window, as with plain ``generate``.

    Example:
        >>> import infopt
        >>> from infopt.models import tiny_model
        >>> m = infopt.optimize(tiny_model(hidden_size=128, num_heads=2, num_kv_heads=1), [Quantized(bits=4)])
        >>> m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False).shape
        torch.Size([1, 7])
    """

    stage: ClassVar[str] = "kvcache"
    kind: ClassVar[str] = "quantized"
    discriminator: ClassVar[str] = "kind"
    fidelity: ClassVar[str] = "lossy"
    bits: int = 8
    group_size: int = 64
    residual_length: int = 128
    axis_key: str = "channel"
    axis_value: str = "token"
    dtype: str = "int"

    def __post_init__(self):
        if self.bits not in (8, 4) or isinstance(self.bits, bool):
            raise bad_field(self, "bits", self.bits, "8 or 4")
        if self.dtype not in DTYPES:
            raise bad_field(self, "dtype", self.dtype, "int (KIVI codes, bits 8 or 4), fp8 (float8_e4m3fn, bits 8)")
        if self.dtype == "fp8":
            self._check_fp8_fields()
            return
        if not _positive_int(self.group_size):
            raise bad_field(self, "group_size", self.group_size, "a positive integer (tokens or channels per group)")
        if not _positive_int(self.residual_length) or self.residual_length % self.group_size:
            raise bad_field(self, "residual_length", self.residual_length,
                            f"a positive multiple of group_size={self.group_size} (whole key groups are quantized)")
        if self.axis_key not in AXES:
            raise bad_field(self, "axis_key", self.axis_key, ", ".join(AXES))
        if self.axis_value not in AXES:
            raise bad_field(self, "axis_value", self.axis_value, ", ".join(AXES))

    def _check_fp8_fields(self) -> None:
        if self.bits != 8:
            raise bad_field(self, "bits", self.bits, "8 with dtype='fp8' (float8_e4m3fn is 8 bits; use dtype='int' "
                                                     "for bits=4)")
        for name in _INT_ONLY:
            default = type(self).__dataclass_fields__[name].default
            if getattr(self, name) != default:
                raise bad_field(self, name, getattr(self, name),
                                f"{default!r} with dtype='fp8' (one scale per token per head; {name} applies to "
                                "dtype='int')")
        if not isinstance(self.residual_length, int) or isinstance(self.residual_length, bool) or \
                self.residual_length < 0:
            raise bad_field(self, "residual_length", self.residual_length,
                            "a non-negative integer with dtype='fp8' (0: every token stored as fp8)")

    def fields_dict(self):
        out = super().fields_dict()
        if self.dtype == "int":
            del out["dtype"]  # int caches keep the spelling they had before the field existed
        else:
            for name in _INT_ONLY:
                del out[name]
        return out

    def check(self, model, info: ModelInfo, steps) -> list[str]:
        # every layer keeps all its tokens (sliding-window layers too; the model's mask applies the window)
        require_full_attention(model, f"kvcache.{type(self).__name__}", windows=True)
        if self.dtype == "fp8":
            if fp8_dtype() is None:
                raise IncompatibleModelError(
                    f"kvcache.Quantized(dtype='fp8') needs torch.float8_e4m3fn, which torch {torch.__version__} "
                    "lacks; upgrade torch, or use dtype='int' (bits=8)"
                )
            return []
        token_axes = [n for n, a in (("axis_key", self.axis_key), ("axis_value", self.axis_value)) if a == "token"]
        if token_axes and info.head_dim % min(self.group_size, info.head_dim):
            divisors = [d for d in range(1, info.head_dim + 1) if info.head_dim % d == 0 and d >= 8]
            raise IncompatibleModelError(
                f"kvcache.Quantized(group_size={self.group_size}) groups {' and '.join(token_axes)} along head_dim, "
                f"but this model's head_dim is {info.head_dim}; use a group_size dividing it "
                f"({', '.join(map(str, divisors)) or info.head_dim})"
            )
        if self.bits == 4 and info.head_dim % 2:
            raise IncompatibleModelError(
                f"kvcache.Quantized(bits=4) packs two values per byte along head_dim, which is odd ({info.head_dim}) "
                "here; use bits=8"
            )
        return []

    def new_cache(self, model: nn.Module):
        """A fresh :class:`~infopt.kvcache.quantized_cache.QuantizedKVCache` for ``model`` (for ``generate(past_key_values=...)``
        or a hand-written loop)."""
        return QuantizedKVCache(model.config, self)


# -- accounting ----------------------------------------------------------------------------------------


def bytes_per_token(info: ModelInfo, config: Quantized) -> tuple[float, int]:
    """``(quantized, dense)`` KV bytes one token costs across all layers, once past the residual window.

    Example:
        >>> from infopt.models import tiny_model
        >>> q, d = bytes_per_token(inspect_model(tiny_model(hidden_size=128, num_heads=2, num_kv_heads=1)), Quantized())
        >>> round(q / d, 3)
        0.281
        >>> q, d = bytes_per_token(inspect_model(tiny_model(hidden_size=128, num_heads=2, num_kv_heads=1)),
        ...                        Quantized(dtype="fp8"))
        >>> round(q / d, 3)
        0.266
    """
    d = info.head_dim
    if config.dtype == "fp8":
        # K and V: one byte per element plus an fp32 scale per token per head
        return 2 * (d + 4) * info.num_layers * info.num_kv_heads, info.kv_bytes_per_token
    sb = torch.finfo(scale_dtype_for(info.dtype)).bits // 8
    dense = info.kv_bytes_per_token
    # K and V: codes, plus a (scale, zero) pair per group: a channel's group spans group_size tokens, a token's
    # group min(group_size, head_dim) channels
    groups = sum(d / (config.group_size if axis == "channel" else min(config.group_size, d))
                 for axis in (config.axis_key, config.axis_value))
    per_head = 2 * d * config.bits / 8 + 2 * sb * groups
    return per_head * info.num_layers * info.num_kv_heads, dense


# -- installation --------------------------------------------------------------------------------------


@register_use(Quantized)
def use_(model: nn.Module, config: Quantized, *, step: str | None = None) -> nn.Module:
    """Make ``model.generate`` decode with a fresh :class:`Quantized` cache per call, in place.

    Calls it cannot serve (beam search and the strategies of
    :data:`~infopt.generate.BEAM_KWARGS`, a caller-supplied ``past_key_values`` or
    ``cache_implementation``, ``use_cache=False``) go to the original ``generate``. Left-padded batches are served.

    Args:
        model: a transformers causal LM.
        config: the :class:`Quantized` config.
        step: recipe step key for the report.

    Returns:
        The same model.

    Raises:
        IncompatibleModelError: see :meth:`Quantized.check`.

    Example:
        >>> from infopt.models import tiny_model
        >>> m = use_(tiny_model(hidden_size=128, num_heads=2, num_kv_heads=1), Quantized(bits=8))
        >>> m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False).shape
        torch.Size([1, 5])
    """
    info = inspect_model(model)
    config.check(model, info, (config,))

    key = step or config.key
    set_part(model, "cache", FreshCache(model, config, key), step=key)
    return model


@register_transform(Quantized)
def _apply(model: nn.Module, config: Quantized, ctx: ApplyContext) -> None:
    use_(model, config)
    info = ctx.info or inspect_model(model)
    q, dense = bytes_per_token(info, config)
    fp32 = 2 * info.num_layers * info.num_kv_heads * info.head_dim * 4
    tokens = min(int(context_length(model) or 4096), 4096)
    ctx.stats.update({
        "kv_bytes_per_token": round(q, 1),
        "kv_bytes_per_token_dense": dense,
        "kv_ratio_vs_fp32": round(q / fp32, 4),
        f"kv_bytes_saved_at_{tokens}_tokens": int((dense - q) * tokens),
    })
    if config.dtype == "fp8":
        what = f"fp8 (float8_e4m3fn) KV cache (a scale per token per head, last {config.residual_length} tokens exact)"
    else:
        what = (f"int{config.bits} KV cache (keys per {config.axis_key}, values per {config.axis_value}, groups of "
                f"{config.group_size}, last {config.residual_length} tokens exact)")
    ctx.notes.append(
        f"{what}: {q / fp32:.2f}x of fp32 KV bytes, {(dense - q) * tokens / 2**20:.1f} MiB saved per sequence at "
        f"{tokens} tokens"
    )
