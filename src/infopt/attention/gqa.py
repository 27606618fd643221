"""SDPA that hands grouped-query K/V heads to the kernel as they are, for compiled decoding on CPU.

``transformers``' SDPA path repeats each K/V head for its query group (``repeat_kv``) whenever a mask
is passed, except for eager one-token steps, which it folds into the query instead. A static cache
always passes a mask, and a compiled decode step takes the repeat path, so every token copies the
whole cache ``num_key_value_groups`` times per layer (the default model: two 0.6 MB copies per layer
per token at a 256-token cache, growing with the cache). PyTorch's CPU SDPA kernel takes grouped
heads with a mask directly (``enable_gqa=True``) and gives the same result without the copies.

This backend does that on CPU and defers to ``transformers``' SDPA everywhere else (on CUDA the
masked GQA path is the slower math kernel). It is registered under :data:`GQA_SDPA_IMPL` with
SDPA's mask builder.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import cpp
from . import paged
from .registry import register_attention

__all__ = ["GQA_SDPA_IMPL", "register_gqa_sdpa", "gqa_sdpa_forward", "static_cache_attention", "KV_LEN_KWARG",
           "PROMPT_DTYPE_ATTR", "PROMPT_MIN_ROWS", "prompt_dtype"]

GQA_SDPA_IMPL = "infopt_sdpa_gqa"


def gqa_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs):
    """An ``AttentionInterface`` function: ``[B, H, q, d]`` query, ``[B, H_kv, k, d]`` key/value. A module set to a
    prompt dtype (:func:`prompt_dtype`) attends in it on long fp32 prompts on a CPU: query, keys and values rounded
    to it, the kernel's softmax and sums in fp32, the output returned in fp32.

    Returns:
        ``([B, q, H, d]`` attention output, None).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kv_len = kwargs.get(KV_LEN_KWARG)
    if kv_len is not None and _static_kernel_ok(module, query, key, value, dropout, kwargs):
        return static_cache_attention(query, key, value, kv_len, scaling, window=_window(module, kwargs)), None
    dtype = query.dtype
    low = prompt_dtype(module, query)  # a long prompt's attention in bf16 (Attention(prompt_dtype=...)), or None
    compute = low or dtype
    groups = getattr(module, "num_key_value_groups", 1)
    if (query.device.type != "cpu" or groups == 1 or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or kwargs.get("output_attentions", False)
            or key.shape[-1] != value.shape[-1]):
        if low is not None and kwargs.get("output_attentions", False):
            compute, low = dtype, None  # weights asked for: the model's own precision
        query, key, value, attention_mask = _cast(compute, query, key, value, attention_mask)
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                              scaling=scaling, is_causal=is_causal, **kwargs)
        return (out if low is None else out.to(dtype)), weights
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # as transformers decides it: the causal flag only for a maskless multi-token query
    q_length = query.shape[2]
    is_causal = q_length > 1 and attention_mask is None and is_causal
    if is_causal and key.shape[2] > q_length:  # a maskless prefill into an empty static cache: its slots after the prompt
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    # (a 16-bit static cache, kvcache.Static(dtype=...), is read as a copy in the compute dtype)
    query, key, value, attention_mask = _cast(compute, query, key, value, attention_mask)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
                                         is_causal=is_causal, enable_gqa=True)
    out = out.transpose(1, 2)
    if low is None:
        return out.contiguous(), None
    return torch.empty(out.shape, dtype=dtype, device=out.device).copy_(out), None  # one copy: layout and dtype


PROMPT_DTYPE_ATTR = "infopt_prompt_dtype"
"""The attribute :class:`~infopt.attention.backends.Attention` ``(prompt_dtype=...)`` sets on a model's attention
modules: the dtype their long prompts attend in (:func:`prompt_dtype`)."""

PROMPT_MIN_ROWS = 64
"""Query tokens from which a module set to a prompt dtype attends in it (shorter calls, decode and verify steps,
attend in the model's dtype)."""


def prompt_dtype(module: torch.nn.Module, query: torch.Tensor) -> torch.dtype | None:
    """The dtype this call of ``module`` attends in when it is not the query's: the module's prompt dtype
    (:data:`PROMPT_DTYPE_ATTR`) for an fp32 query of at least :data:`PROMPT_MIN_ROWS` tokens on a CPU, else None.

    Example:
        >>> layer = torch.nn.Module()
        >>> setattr(layer, PROMPT_DTYPE_ATTR, torch.bfloat16)
        >>> prompt_dtype(layer, torch.zeros(1, 4, 512, 64)), prompt_dtype(layer, torch.zeros(1, 4, 1, 64))
        (torch.bfloat16, None)
    """
    low = getattr(module, PROMPT_DTYPE_ATTR, None)
    if low is None or query.dtype != torch.float32 or query.device.type != "cpu" or query.shape[2] < PROMPT_MIN_ROWS:
        return None
    return low


def _cast(dtype: torch.dtype, query, key, value, mask):
    """The operands in ``dtype`` (an additive float mask too; a boolean one as it is)."""
    if query.dtype != dtype:
        query = query.to(dtype)
    if key.dtype != dtype:
        key, value = key.to(dtype), value.to(dtype)
    if mask is not None and mask.is_floating_point() and mask.dtype != dtype:
        mask = mask.to(dtype)
    return query, key, value, mask


KV_LEN_KWARG = "infopt_kv_len"
"""The keyword the compiled decode step passes down to the attention layers on unpadded calls over a static cache:
an int64 tensor ``[1]``, the keys every row holds after this step's writes. With it (on CPU, where the paged
attention kernel is built) attention runs :func:`static_cache_attention`, which reads only those keys and ignores
the mask (for such calls it is the causal mask over them)."""

_STATIC_BLOCK = 16  # keys per block in the paged kernel's view of a static cache


def _window(module, kwargs) -> int:
    """A layer's sliding window, as the layer's attribute (Gemma 3) or the call's keyword (Mistral); 0: none."""
    window = getattr(module, "sliding_window", None) or kwargs.get("sliding_window")
    return int(window) if window else 0


def _static_kernel_ok(module, query, key, value, dropout, kwargs) -> bool:
    return (query.device.type == "cpu" and not dropout and getattr(module, "is_causal", True)
            and kwargs.get("position_bias") is None
            and kwargs.get("softcap") is None and kwargs.get("s_aux") is None
            and not kwargs.get("output_attentions", False)
            and query.dtype in (torch.float32, torch.bfloat16) and key.dtype == value.dtype
            and key.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and query.shape[-1] == key.shape[-1] == value.shape[-1] and key.shape[2] % _STATIC_BLOCK == 0
            and query.shape[1] % key.shape[1] == 0 and paged._USE_CPU_KERNEL[0]
            and cpp.loaded("paged_attention"))  # loaded by whoever passes the keyword (nothing is built while tracing)


def static_cache_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_len: torch.Tensor,
                           scaling: float | None = None, *, window: int = 0) -> torch.Tensor:
    """Causal attention of ``q`` new tokens per row over a static cache's first ``kv_len`` keys, on the C++ paged
    attention kernel (``torch.ops.infopt.paged_attention``), which reads the cache in place. With a sliding
    ``window``, each query reads only its window's keys (itself and the ``window - 1`` before it, transformers'
    rule): a sliding layer's step costs the window, not the cache, however long the call grew.

    The cache ``[B, H_kv, L, d]`` is viewed as a block pool ``[B * H_kv * L / 16, 16, H_kv, d]`` (blocks of 16
    tokens of one row, each block's heads ``L * d`` apart) with a block table per row, so each key row is read once
    for its query group, keys past ``kv_len`` are never read, and long caches can be split over the threads.

    Args:
        query: ``[B, H, q, d]``, the ``q`` new tokens being the last of each row's ``kv_len`` keys.
        key, value: ``[B, H_kv, L, d]``, contiguous.
        kv_len: int64 ``[1]`` (or ``[B]``): keys per row after this step.
        scaling: the softmax scale (default ``d ** -0.5``).
        window: the layer's sliding window in tokens; 0 for full attention.

    Returns:
        ``[B, q, H, d]`` (the layout transformers' attention functions return).
    """
    b, h, q, d = query.shape
    h_kv, length = key.shape[1], key.shape[2]
    per_row = length // _STATIC_BLOCK
    n_blocks = (b - 1) * h_kv * per_row + per_row
    strides = (_STATIC_BLOCK * d, d, length * d, 1)
    k_pool = key.contiguous().as_strided((n_blocks, _STATIC_BLOCK, h_kv, d), strides)
    v_pool = value.contiguous().as_strided((n_blocks, _STATIC_BLOCK, h_kv, d), strides)
    rows = torch.arange(b, device=query.device, dtype=torch.int32).unsqueeze(1) * (h_kv * per_row)
    table = rows + torch.arange(per_row, device=query.device, dtype=torch.int32)
    starts = torch.arange(0, b * q + 1, q, device=query.device, dtype=torch.int64)
    lens = kv_len.to(torch.int64).expand(b).contiguous()
    flat = query.transpose(1, 2).reshape(b * q, h, d)
    out = torch.ops.infopt.paged_attention(flat, k_pool, v_pool, table, starts, lens,
                                           scaling if scaling is not None else d ** -0.5, window)
    return out.view(b, q, h, d)


def register_gqa_sdpa() -> str:
    """Register the backend with transformers (idempotent; global, harmless for models not set to it).

    Example:
        >>> register_gqa_sdpa()
        'infopt_sdpa_gqa'
    """
    return register_attention(GQA_SDPA_IMPL, gqa_sdpa_forward)
