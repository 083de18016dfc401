"""make_kv_cache_manager: the KV cache manager a KV cache spec calls for."""

from __future__ import annotations

from typing import Any

from pagedkv.kv.coordinator import HybridKVCacheManager
from pagedkv.kv.hybrid_spec import HybridKVCacheSpec
from pagedkv.kv.interface import KVCacheManagerAPI
from pagedkv.kv.manager import KVCacheManager
from pagedkv.kv.single_type import block_table_policy_for_spec
from pagedkv.kv.spec import KVCacheSpec


def make_kv_cache_manager(spec: KVCacheSpec, *, num_blocks: int,
                          **kwargs: Any) -> KVCacheManagerAPI:
    """A manager for `spec`. A HybridKVCacheSpec (layers of mixed attention types) gets the
    coordinator over one manager per KV cache group (coordinator.py); any other spec one
    `KVCacheManager` with its block size and the block-table policy it calls for (sliding
    window only when every layer slides). `kwargs` as for KVCacheManager's constructor, plus
    `max_num_batched_tokens`, which only the coordinator's admission reads."""
    if isinstance(spec, HybridKVCacheSpec):
        return HybridKVCacheManager(spec, num_blocks=num_blocks, **kwargs)
    kwargs.pop("max_num_batched_tokens", None)
    policy = block_table_policy_for_spec(spec)
    return KVCacheManager(num_blocks=num_blocks, block_size=spec.block_size,
                          sliding_window=policy.sliding_window, **kwargs)
