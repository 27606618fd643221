"""Quality against the original model: perplexity, KL divergence, top-1 agreement, on text every Python has."""

from .metrics import (
    Reference,
    compare,
    default_text,
    encode_text,
    gate_failures,
    logit_metrics,
    reference_logits,
)

__all__ = [
    "Reference",
    "compare",
    "default_text",
    "encode_text",
    "gate_failures",
    "logit_metrics",
    "reference_logits",
]
