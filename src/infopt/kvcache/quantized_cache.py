"""The transformers ``Cache`` behind :class:`~infopt.kvcache.Quantized`, and the KV layout of its codes.

It imports nothing from :mod:`infopt.kvcache.quantized` (the config imports this module), and takes its
formulas from :mod:`infopt.quantize.formats.primitives`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..core.introspect import text_config
from ..quantize.formats.fp8 import dequantize_fp8, quantize_fp8
from ..quantize.formats.primitives import (
    choose_qparams,
    dequantize,
    group_block,
    pack_int4,
    quantize,
    scale_dtype_for,
    unpack_int4,
)
from .api import BatchMappedLayer, CacheBytes, cache_bytes, tensor_bytes

if TYPE_CHECKING:
    from .quantized import Quantized

__all__ = ["QuantizedKVCache", "QuantizedKVLayer", "quantize_groups", "dequantize_groups"]


# -- the KV layout: KIVI groups along tokens (per channel) or channels (per token) ------------------------
def _kv_block(shape: torch.Size, group_size: int, axis: str) -> tuple[int, ...]:
    # x: [..., T, D]; "channel": a scale per channel per group of tokens; "token": per token per group of channels
    return group_block(shape, group_size, -2 if axis == "channel" else -1)


def quantize_groups(x: torch.Tensor, bits: int, group_size: int, axis: str,
                    scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization of ``x: [..., T, D]`` in groups (codes ``0..2^bits-1``, the zero point
    the group's minimum: ``zero_domain="value"`` of :func:`~infopt.quantize.formats.primitives.choose_qparams`).

    Args:
        x: the tensor; ``T`` a multiple of ``group_size`` for ``axis="channel"``, ``D`` for ``"token"``.
        bits: 8 or 4 (4-bit codes are packed two per byte along ``D``, low nibble first).
        group_size: elements sharing one scale and zero-point.
        axis: ``"channel"``: a scale per channel per group of tokens, shape ``[..., T/G, D]``;
            ``"token"``: a scale per token per group of channels, ``[..., T, D/G]``.
        scale_dtype: dtype scales and zero-points are stored in.

    Returns:
        ``(codes, scale, zero)``: ``codes`` uint8 ``[..., T, D]`` (``[..., T, D/2]`` for 4 bits);
        ``x ~= codes * scale + zero`` with an error of at most ``scale / 2`` per element.

    Raises:
        ValueError: a dimension not divisible by ``group_size``.

    Example:
        >>> x = torch.randn(1, 2, 64, 16)
        >>> codes, scale, zero = quantize_groups(x, 8, 16, "token")
        >>> codes.shape, scale.shape
        (torch.Size([1, 2, 64, 16]), torch.Size([1, 2, 64, 1]))
        >>> bool(((dequantize_groups(codes, scale, zero, 8, 16, "token") - x).abs() <= scale.repeat_interleave(16, -1) / 2 + 1e-6).all())
        True
    """
    t, d = x.shape[-2], x.shape[-1]
    if (axis == "channel" and t % group_size) or (axis == "token" and d % group_size):
        raise ValueError(f"quantize_groups: shape {tuple(x.shape)} does not split into groups of {group_size} "
                         f"along the {'token' if axis == 'channel' else 'channel'} dimension")
    qmax = (1 << bits) - 1
    block = _kv_block(x.shape, group_size, axis)
    # no floor: a constant group gets scale 0 and codes 0, and dequantizes to its value exactly. The codes are
    # computed from the stored (rounded) scale and zero, so dequantization matches what was encoded
    scale, zero = choose_qparams(x, block, qmin=0, qmax=qmax, symmetric=False, zero_domain="value",
                                 scale_dtype=scale_dtype)
    codes = quantize(x, block, scale, zero, qmin=0, qmax=qmax, zero_domain="value")
    return (pack_int4(codes) if bits == 4 else codes), scale, zero


def dequantize_groups(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int,
                      axis: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_groups`: ``codes * scale + zero``, computed in fp32, as ``dtype``, shape ``[..., T, D]``.

    Example:
        >>> x = torch.full((1, 1, 4, 8), 3.25)
        >>> torch.equal(dequantize_groups(*quantize_groups(x, 4, 4, "channel"), 4, 4, "channel"), x)
        True
    """
    q = unpack_int4(codes) if bits == 4 else codes
    return dequantize(q, _kv_block(q.shape, group_size, axis), scale, zero, zero_domain="value").to(dtype)


class _Growing:
    """A tensor that grows along dim 2 (tokens or token groups) with doubling spare capacity, so appending a
    chunk copies the store only O(log n) times."""

    def __init__(self):
        self.buf: torch.Tensor | None = None
        self.n = 0

    def append(self, x: torch.Tensor) -> None:
        t = x.shape[2]
        if self.buf is None:
            self.buf = torch.empty_like(x, memory_format=torch.contiguous_format)
        elif self.n + t > self.buf.shape[2]:
            cap = max(self.n + t, 2 * self.buf.shape[2])
            grown = self.buf.new_empty((*self.buf.shape[:2], cap, *self.buf.shape[3:]))
            grown[:, :, : self.n] = self.buf[:, :, : self.n]
            self.buf = grown
        self.buf[:, :, self.n : self.n + t] = x
        self.n += t

    def view(self) -> torch.Tensor:
        return self.buf[:, :, : self.n]

    def tail(self, t: int) -> torch.Tensor:
        return self.buf[:, :, self.n - t : self.n]

    def truncate(self, t: int) -> None:
        self.n -= t

    def map_batch(self, fn) -> None:
        if self.buf is not None:
            self.buf = fn(self.buf)

    def allocated(self) -> int:
        return tensor_bytes(self.buf)

    def used(self) -> int:
        return 0 if self.buf is None else self.buf[:, :, : self.n].numel() * self.buf.element_size()


class QuantizedKVLayer(BatchMappedLayer, CacheLayerMixin):
    """One layer of a :class:`QuantizedKVCache`.

    State: a full-precision residual buffer ``[B, H_kv, R, D]`` for keys and for values (``self.keys`` /
    ``self.values``, ``n_res`` tokens live), and quantized stores of ``n_quant`` tokens, whole multiples
    of ``R = residual_length`` until a crop: int codes, scales and zero-points (``dtype="int"``), or
    float8_e4m3fn values ``[B, H_kv, T, D]`` and fp32 scales ``[B, H_kv, T, 1]`` (``dtype="fp8"``; with
    ``R = 0`` every token goes to the store on arrival).
    """

    is_compileable = False
    is_croppable = False  # crop into the quantized part brings tokens back dequantized, not as they were
    is_sliding = False

    def __init__(self, bits: int, group_size: int, residual_length: int, axis_key: str, axis_value: str,
                 kv_dtype: str = "int"):
        super().__init__()
        self.bits, self.group_size, self.residual_length = bits, group_size, residual_length
        self.axis_key, self.axis_value = axis_key, axis_value
        self.fp8 = kv_dtype == "fp8"
        self.n_res = 0
        self.n_quant = 0
        self._stores: dict[str, _Growing] = {}

    # -- state -------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        # residual: [B, H_kv, R, D] in the model's dtype, allocated once
        self.keys = key_states.new_empty((b, h, self.residual_length, d))
        self.values = value_states.new_empty((b, h, self.residual_length, value_states.shape[-1]))
        self.scale_dtype = torch.float32 if self.fp8 else scale_dtype_for(self.dtype)
        names = ("k", "k_scale", "v", "v_scale") if self.fp8 else ("k", "k_scale", "k_zero", "v", "v_scale", "v_zero")
        self._stores = {name: _Growing() for name in names}
        self.n_res = self.n_quant = 0
        # elements per group: group_size tokens per channel; per token, group_size channels but never more than one
        # head's (a model whose head_dim is below group_size quantizes each token's head as one group)
        self._group = {name: self.group_size if axis == "channel" else min(self.group_size, x.shape[-1])
                       for name, axis, x in (("k", self.axis_key, key_states), ("v", self.axis_value, value_states))}
        self.is_initialized = True

    def _append_quantized(self, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [B, H_kv, m*R, D] full precision
        if self.fp8:
            for prefix, x in (("k", k), ("v", v)):
                codes, scale = quantize_fp8(x, "row")  # [B, H_kv, T, D] fp8, [B, H_kv, T, 1] fp32
                self._stores[prefix].append(codes)
                self._stores[f"{prefix}_scale"].append(scale)
            self.n_quant += k.shape[-2]
            return
        for prefix, x, axis in (("k", k, self.axis_key), ("v", v, self.axis_value)):
            codes, scale, zero = quantize_groups(x, self.bits, self._group[prefix], axis, self.scale_dtype)
            self._stores[prefix].append(codes)
            self._stores[f"{prefix}_scale"].append(scale)
            self._stores[f"{prefix}_zero"].append(zero)
        self.n_quant += k.shape[-2]

    def _dequantized(self, prefix: str, axis: str) -> torch.Tensor:
        s = self._stores
        if self.fp8:
            return dequantize_fp8(s[prefix].view(), s[f"{prefix}_scale"].view(), self.dtype)
        return dequantize_groups(s[prefix].view(), s[f"{prefix}_scale"].view(), s[f"{prefix}_zero"].view(),
                                 self.bits, self._group[prefix], axis, self.dtype)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append new K/V (``[B, H_kv, q, D]``); return every token's K/V, the quantized part dequantized.

        The residual absorbs the new tokens; each time it reaches ``residual_length`` tokens, whole
        chunks of that size are quantized into the store (after this call's attention, which still
        sees them exact).
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        r, q = self.residual_length, key_states.shape[-2]
        if self.n_res:
            recent_k = torch.cat([self.keys[:, :, : self.n_res], key_states], dim=-2)
            recent_v = torch.cat([self.values[:, :, : self.n_res], value_states], dim=-2)
        else:
            recent_k, recent_v = key_states, value_states
        if self.n_quant:
            out_k = torch.cat([self._dequantized("k", self.axis_key), recent_k], dim=-2)
            out_v = torch.cat([self._dequantized("v", self.axis_value), recent_v], dim=-2)
        else:
            out_k, out_v = recent_k, recent_v
        total = self.n_res + q
        flush = total if r == 0 else (total // r) * r
        if flush:
            self._append_quantized(recent_k[:, :, :flush], recent_v[:, :, :flush])
            tail = total - flush
            self.keys[:, :, :tail] = recent_k[:, :, flush:]
            self.values[:, :, :tail] = recent_v[:, :, flush:]
            self.n_res = tail
        else:
            self.keys[:, :, self.n_res : total] = key_states
            self.values[:, :, self.n_res : total] = value_states
            self.n_res = total
        return out_k, out_v

    def get_seq_length(self) -> int:
        return self.n_quant + self.n_res

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = None
        self._stores = {}
        self.n_res = self.n_quant = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (a negative count, as transformers' ``DynamicLayer``).

        Cropping into the quantized part moves the last whole chunks back to the residual, dequantized
        (``dtype="int"``), or shortens the fp8 store to the kept tokens and empties the residual (``dtype="fp8"``).
        """
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative count of tokens to remove")
        k = -tokens_to_remove
        if k == 0 or not self.is_initialized:
            return
        if k > self.get_seq_length():
            raise ValueError(f"crop({tokens_to_remove}): the layer holds only {self.get_seq_length()} tokens")
        if k <= self.n_res:
            self.n_res -= k
            return
        k -= self.n_res
        if self.fp8:  # one scale per token: the store shortens by exactly k tokens
            for store in self._stores.values():
                store.truncate(k)
            self.n_quant -= k
            self.n_res = 0
            return
        r = self.residual_length
        m = -(-k // r) * r  # whole chunks to bring back
        back_k = self._tail_dequantized("k", self.axis_key, m)
        back_v = self._tail_dequantized("v", self.axis_value, m)
        for prefix, axis in (("k", self.axis_key), ("v", self.axis_value)):
            groups = m // self.group_size if axis == "channel" else m
            self._stores[prefix].truncate(m)
            self._stores[f"{prefix}_scale"].truncate(groups)
            self._stores[f"{prefix}_zero"].truncate(groups)
        self.n_quant -= m
        self.n_res = m - k
        self.keys[:, :, : self.n_res] = back_k[:, :, : self.n_res]
        self.values[:, :, : self.n_res] = back_v[:, :, : self.n_res]

    def _tail_dequantized(self, prefix: str, axis: str, m: int) -> torch.Tensor:
        groups = m // self.group_size if axis == "channel" else m
        s = self._stores
        return dequantize_groups(s[prefix].tail(m), s[f"{prefix}_scale"].tail(groups), s[f"{prefix}_zero"].tail(groups),
                                 self.bits, self._group[prefix], axis, self.dtype)

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        self.keys, self.values = fn(self.keys), fn(self.values)
        for store in self._stores.values():
            store.map_batch(fn)

    # -- accounting ------------------------------------------------------------------------------
    def num_tokens(self) -> int:
        return self.get_seq_length()

    def allocated_bytes(self) -> int:
        return tensor_bytes(self.keys, self.values) + sum(s.allocated() for s in self._stores.values())

    def used_bytes(self) -> int:
        live = tensor_bytes(self.keys[:, :, : self.n_res], self.values[:, :, : self.n_res])
        return live + sum(s.used() for s in self._stores.values())


class QuantizedKVCache(Cache):
    """A transformers ``Cache`` holding K/V as int8/int4 codes (KIVI) or fp8, plus a full-precision residual window.

    Pass it to ``model.generate(past_key_values=...)`` or a model's forward; :func:`infopt.kvcache.use_`
    with a :class:`~infopt.kvcache.Quantized` config makes ``generate`` build one per call.

    Args:
        config: the model's config (``num_hidden_layers`` is read from its text config).
        quantized: the :class:`~infopt.kvcache.Quantized` settings.

    Example:
        >>> from infopt.kvcache import Quantized
        >>> from infopt.models import tiny_model
        >>> m = tiny_model(hidden_size=128, num_heads=2, num_kv_heads=1)
        >>> cache = QuantizedKVCache(m.config, Quantized(bits=4, residual_length=64))
        >>> _ = m(torch.randint(0, 100, (1, 200)), past_key_values=cache)
        >>> cache.get_seq_length(), cache.layers[0].n_quant, cache.layers[0].n_res
        (200, 192, 8)
    """

    def __init__(self, config, quantized: Quantized):
        tc = text_config(config, decoder=True)
        q = quantized
        layers = [QuantizedKVLayer(q.bits, q.group_size, q.residual_length, q.axis_key, q.axis_value, q.dtype)
                  for _ in range(tc.num_hidden_layers)]
        super().__init__(layers=layers)
        self.quantized = quantized

    def memory_bytes(self) -> CacheBytes:
        """Bytes allocated and used, against a dense cache of the same tokens (see :class:`~infopt.kvcache.api.CacheBytes`)."""
        dtype = next((layer.dtype for layer in self.layers if layer.is_initialized), None)
        return cache_bytes(self.layers, dtype)
