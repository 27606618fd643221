"""Attention backend selection through transformers' attention-function interface (recipe stage ``attention``)."""

from .backends import BACKENDS, Attention, set_backend_

__all__ = ["Attention", "BACKENDS", "set_backend_"]
