"""Attention backend selection through transformers' attention-function interface (recipe stage ``attention``)."""

from .backends import BACKENDS, Attention, set_backend_
from .paged import PAGED_IMPL, PagedAttentionMetadata, paged_attention_forward, register_paged_attention

__all__ = ["Attention", "BACKENDS", "set_backend_", "PAGED_IMPL", "PagedAttentionMetadata", "paged_attention_forward",
           "register_paged_attention"]
