"""The KV-cache memory system: pure Python, no torch.

Specs and planning (`spec`, `plan`), blocks and the free queue (`block`), chained block hashes
(`hashing`), the ref-counted block pool with prefix caching (`block_pool`), and the per-request
manager with copy-on-write, sliding window and swap (`manager`).
"""

from pagedkv.kv.block import FreeBlockQueue, KVCacheBlock
from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from pagedkv.kv.hashing import NONE_HASH, get_hash_fn, hash_block_tokens
from pagedkv.kv.manager import AllocStatus, KVCacheManager
from pagedkv.kv.plan import KVCachePlan, plan_num_blocks
from pagedkv.kv.spec import (
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    kv_cache_spec_from_hf_config,
)

__all__ = [
    "NONE_HASH",
    "AllBlocksCleared",
    "AllocStatus",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "FreeBlockQueue",
    "FullAttentionSpec",
    "KVCacheBlock",
    "KVCacheManager",
    "KVCachePlan",
    "KVCacheSpec",
    "MLAAttentionSpec",
    "SlidingWindowSpec",
    "get_hash_fn",
    "hash_block_tokens",
    "kv_cache_spec_from_hf_config",
    "plan_num_blocks",
]
