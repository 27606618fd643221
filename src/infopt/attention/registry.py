"""Registering infopt's attention functions with transformers' attention interface."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["register_attention"]

_REGISTERED: set[str] = set()


def register_attention(name: str, forward: Callable) -> str:
    """Register ``forward`` in ``AttentionInterface`` and SDPA's mask builder in ``AttentionMaskInterface``,
    both under ``name`` (idempotent), and return ``name``.

    SDPA's masks are what calls the function hands on to SDPA need (padding-aware, additive or boolean).
    The registration is global and stays after :func:`infopt.undo`; it changes nothing for models not set
    to ``name``.
    """
    if name not in _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(name, forward)
        AttentionMaskInterface.register(name, sdpa_mask)
        _REGISTERED.add(name)
    return name
