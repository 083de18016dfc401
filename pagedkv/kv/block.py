"""Physical KV blocks.

A `KVCacheBlock` is a handle for one physical block of KV memory: its id (the index into the
runner's KV tensors), its reference count (how many block tables hold it) and, once it is full
and registered in the prefix cache, the hash of its contents. Blocks are preallocated by the
`BlockPool` and never created or destroyed afterwards.

`prev_free_block` / `next_free_block` are reserved for the pool's eviction policy (see
`pagedkv.kv.eviction`): LRU links the free blocks into an intrusive list through them.
"""

from __future__ import annotations

from pagedkv.kv.hashing import BlockHash


class KVCacheBlock:
    """One physical KV block. Mutated only by `BlockPool` and its eviction policy."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block",
                 "is_null")

    def __init__(self, block_id: int, ref_cnt: int = 0, block_hash: BlockHash | None = None,
                 prev_free_block: KVCacheBlock | None = None,
                 next_free_block: KVCacheBlock | None = None, is_null: bool = False) -> None:
        self.block_id = block_id
        self.ref_cnt = ref_cnt
        # Set while the block is registered in the prefix cache (it may be free: lazy eviction).
        self.block_hash = block_hash
        self.prev_free_block = prev_free_block
        self.next_free_block = next_free_block
        self.is_null = is_null

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return (f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h}"
                f"{', null' if self.is_null else ''})")
