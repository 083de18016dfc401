"""Eviction order of the block pool's free blocks: the interface, and the policies by name.

A new order is a new file with an `EvictionPolicy` subclass, registered in `EVICTION_POLICIES`;
the pool's bookkeeping (ref counts, the prefix-cache map, events) does not change. The engine
argument `eviction_policy` (`--eviction-policy`) names one: `lru` (the default), `lfu`, `arc`.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedkv.kv.block import KVCacheBlock
from pagedkv.kv.eviction.arc import ARCEvictionPolicy
from pagedkv.kv.eviction.base import EvictionPolicy
from pagedkv.kv.eviction.lfu import LFUEvictionPolicy
from pagedkv.kv.eviction.lru import FreeBlockQueue, LRUEvictionPolicy

# name -> policy class; each is built from the pool's usable blocks, all free, in id order.
EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUEvictionPolicy,
    "lfu": LFUEvictionPolicy,
    "arc": ARCEvictionPolicy,
}
DEFAULT_EVICTION_POLICY = "lru"


def eviction_policy_class(name: str) -> Callable[[list[KVCacheBlock]], EvictionPolicy]:
    """The policy registered under `name`; ValueError naming it when there is none."""
    try:
        return EVICTION_POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"eviction_policy must be one of {sorted(EVICTION_POLICIES)}, "
                         f"got {name!r}") from None


def make_eviction_policy(name: str, blocks: list[KVCacheBlock]) -> EvictionPolicy:
    """A `name` policy holding `blocks` (all free, reused in their order at first)."""
    return eviction_policy_class(name)(blocks)


__all__ = ["ARCEvictionPolicy", "DEFAULT_EVICTION_POLICY", "EVICTION_POLICIES", "EvictionPolicy",
           "FreeBlockQueue", "LFUEvictionPolicy", "LRUEvictionPolicy", "eviction_policy_class",
           "make_eviction_policy"]
