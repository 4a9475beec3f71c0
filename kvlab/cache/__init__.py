"""KV-cache storage. Knows tensors, token ids and counters only: no models, no scheduling, no drawing."""

from kvlab.cache.naive import CacheShape, ContiguousCache, StaticCache, static_tokens_stored, static_utilization
from kvlab.cache.paged import BlockManager, OutOfBlocksError, block_hash
from kvlab.cache.paged_storage import PagedKVCache

CACHE_KINDS = ("none", "dynamic", "static", "paged")

__all__ = ["CacheShape", "ContiguousCache", "StaticCache", "static_tokens_stored", "static_utilization", "BlockManager", "OutOfBlocksError",
           "block_hash", "PagedKVCache", "CACHE_KINDS"]
