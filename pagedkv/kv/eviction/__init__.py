"""Eviction order of the block pool's free blocks: the interface, and LRU (the default).

A new order (LFU, ARC, ...) is a new file with an `EvictionPolicy` subclass, passed to
`BlockPool(eviction_policy=...)`; the pool's bookkeeping (ref counts, the prefix-cache map,
events) does not change.
"""

from pagedkv.kv.eviction.base import EvictionPolicy
from pagedkv.kv.eviction.lru import FreeBlockQueue, LRUEvictionPolicy

__all__ = ["EvictionPolicy", "FreeBlockQueue", "LRUEvictionPolicy"]
