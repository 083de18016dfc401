"""KV-cache events for a cache-aware router, drained with `BlockPool.take_events()`."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.kv.hashing import BlockHash


@dataclass
class BlockStored:
    """Blocks registered in the prefix cache: a chain hanging off `parent_block_hash`.

    `token_ids` are the tokens of all `block_hashes` blocks, `block_size` per block.
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    # KV cache groups (vLLM's fields): which group's blocks these are, its kind
    # ("full_attention" / "sliding_window") and window; the cache manager (or the hybrid
    # coordinator) sets the kind when it drains the pool's events (group 0 for one group).
    group_idx: int = 0
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    # Per block, its extra keys in vLLM's untagged event form (`event_extra_keys`): the
    # cache salt of a request's first block, a LoRA name. None when not given.
    extra_keys: list[tuple | None] | None = None


@dataclass
class BlockRemoved:
    """Blocks evicted from the prefix cache (their memory was reused)."""

    block_hashes: list[BlockHash]
    group_idx: int = 0  # as in BlockStored
    kv_cache_spec_kind: str | None = None


@dataclass
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
