"""KV-cache storage. Knows tensors and counters only: no models, no scheduling, no drawing."""

from kvlab.cache.naive import CacheShape, ContiguousCache, StaticCache, static_utilization

CACHE_KINDS = ("none", "dynamic", "static")

__all__ = ["CacheShape", "ContiguousCache", "StaticCache", "CACHE_KINDS", "static_utilization"]
