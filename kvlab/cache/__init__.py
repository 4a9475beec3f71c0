"""KV-cache storage: tensors, token ids and counters only, no models, no scheduling, no drawing.

Contiguous caches (notebook 01), the block manager (notebook 02), and float and quantized paged
pools behind one interface (``paged_storage`` lists it; quantized: notebook 03).
"""

from kvlab.cache.naive import CacheShape, ContiguousCache, StaticCache, static_tokens_stored, static_utilization
from kvlab.cache.paged import BlockManager, OutOfBlocksError, block_hash
from kvlab.cache.paged_storage import PagedKVCache
from kvlab.cache.quantized import QuantizedPagedKVCache, saturation_summary

CACHE_KINDS = ("none", "dynamic", "static", "paged")

__all__ = ["CacheShape", "ContiguousCache", "StaticCache", "static_tokens_stored", "static_utilization", "BlockManager", "OutOfBlocksError",
           "block_hash", "PagedKVCache", "QuantizedPagedKVCache", "saturation_summary", "CACHE_KINDS"]
