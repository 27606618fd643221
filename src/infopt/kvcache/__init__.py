"""KV caches (recipe stage ``kvcache``): cache layouts used by ``generate`` without code changes."""

from .api import CacheBytes, use_
from .blocks import BlockAllocator, BlockStateError, OutOfBlocks
from .heavy_hitter import HeavyHitter
from .paged import Paged, paged_pool, use_paged_
from .paged_cache import PagedBatch, PagedCache
from .pool import KVBlockPool, num_blocks_for_budget
from .quantized import Quantized
from .sinks import Sinks
from .static import Static

__all__ = ["Static", "Quantized", "Sinks", "HeavyHitter", "CacheBytes", "use_",
           "Paged", "PagedCache", "PagedBatch", "KVBlockPool", "BlockAllocator", "OutOfBlocks", "BlockStateError",
           "num_blocks_for_budget", "paged_pool", "use_paged_"]
