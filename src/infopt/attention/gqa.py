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

from .registry import register_attention

__all__ = ["GQA_SDPA_IMPL", "register_gqa_sdpa", "gqa_sdpa_forward"]

GQA_SDPA_IMPL = "infopt_sdpa_gqa"


def gqa_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs):
    """An ``AttentionInterface`` function: ``[B, H, q, d]`` query, ``[B, H_kv, k, d]`` key/value.

    Returns:
        ``([B, q, H, d]`` attention output, None).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if (query.device.type != "cpu" or groups == 1 or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or kwargs.get("output_attentions", False)
            or key.shape[-1] != value.shape[-1]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # as transformers decides it: the causal flag only for a maskless multi-token query
    q_length = query.shape[2]
    is_causal = q_length > 1 and attention_mask is None and is_causal
    if is_causal and key.shape[2] > q_length:  # a maskless prefill into an empty static cache: its slots after the prompt
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
                                         is_causal=is_causal, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def register_gqa_sdpa() -> str:
    """Register the backend with transformers (idempotent; global, harmless for models not set to it).

    Example:
        >>> register_gqa_sdpa()
        'infopt_sdpa_gqa'
    """
    return register_attention(GQA_SDPA_IMPL, gqa_sdpa_forward)
