"""KV caches (recipe stage ``kvcache``): cache layouts used by ``generate`` without code changes."""

from .static import Static, use_

__all__ = ["Static", "use_"]
