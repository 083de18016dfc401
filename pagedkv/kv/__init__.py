"""The KV-cache memory system: pure Python, no torch.

Specs and planning (`spec`, `plan`), blocks (`block`), chained block hashes (`hashing`), the
ref-counted block pool with prefix caching (`block_pool`) and the order it reuses free blocks in
(`eviction`: LRU), and the per-request manager with copy-on-write and swap (`manager`), whose
per-attention-type block rules (full attention, sliding window) are `single_type`. The
scheduler sees either manager through `interface.KVCacheManagerAPI`, built by
`factory.make_kv_cache_manager`.
"""

from pagedkv.kv.block import KVCacheBlock
from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from pagedkv.kv.eviction import EvictionPolicy, FreeBlockQueue, LRUEvictionPolicy
from pagedkv.kv.factory import make_kv_cache_manager
from pagedkv.kv.hashing import NONE_HASH, get_hash_fn, hash_block_tokens
from pagedkv.kv.hf_spec import kv_cache_spec_from_hf_config
from pagedkv.kv.interface import KVCacheManagerAPI
from pagedkv.kv.manager import AllocStatus, KVCacheManager
from pagedkv.kv.plan import KVCachePlan, plan_num_blocks
from pagedkv.kv.spec import FullAttentionSpec, KVCacheSpec, MLAAttentionSpec, SlidingWindowSpec

__all__ = [
    "NONE_HASH",
    "AllBlocksCleared",
    "AllocStatus",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "EvictionPolicy",
    "FreeBlockQueue",
    "FullAttentionSpec",
    "KVCacheBlock",
    "KVCacheManager",
    "KVCacheManagerAPI",
    "KVCachePlan",
    "LRUEvictionPolicy",
    "KVCacheSpec",
    "MLAAttentionSpec",
    "SlidingWindowSpec",
    "get_hash_fn",
    "hash_block_tokens",
    "kv_cache_spec_from_hf_config",
    "make_kv_cache_manager",
    "plan_num_blocks",
]
