"""Block-level observation of a `BlockPool`: the feed behind the live dashboard (issue 23).

A pool's `observer` is None unless someone watches (a dashboard client is connected): each
mutating pool method then pays one attribute test and nothing else. With an observer set, the
pool reports every state change of its blocks as it happens, in order:

- `on_refs(blocks)`: these blocks' `ref_cnt` changed (read the new value from the block). The
  order is the order the pool handed the blocks to its eviction policy, so a consumer can
  rebuild the free order (LRU order) from it: a block whose count reaches 0 while it carries a
  hash joins the tail of the cached free order; one whose count leaves 0 leaves it.
- `on_evicted(block, block_hash)`: the block's hash was dropped because its memory was reused.
- `on_cached(block, block_hash, parent_hash)`: the block was registered in the prefix cache.
- `on_uncached(blocks)`: these blocks' hashes were dropped by a prefix-cache reset (kept pins).
- `on_cleared()`: every hash was dropped.
- `on_pins(block_ids, counts)`: pinned-prefix reference counts (device pool only).

`BlockOpRecorder` turns those calls into the compact op stream the dashboard ships (plain lists
of ints and short strings, JSON-ready), and `pool_snapshot` is the state the stream rebuilds.
Both are called only from the thread that mutates the pool (the engine loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from pagedkv.kv.block import KVCacheBlock
from pagedkv.kv.eviction import EvictionPolicy
from pagedkv.kv.hashing import BlockHash

HASH_HEX_CHARS = 16  # the dashboard names a block hash by its first 8 bytes


def short_hash(block_hash: BlockHash | None) -> str | None:
    """The dashboard's name of a block hash (hex of its first 8 bytes), None for None."""
    return None if block_hash is None else block_hash[:HASH_HEX_CHARS // 2].hex()


class ObservedPool(Protocol):
    """What a snapshot reads of a pool (block_pool.BlockPool, which reports to the observer)."""

    num_blocks: int
    blocks: list[KVCacheBlock]
    eviction: EvictionPolicy


class BlockPoolObserver:
    """Receives a pool's block state changes (see the module docstring). No-op defaults."""

    def on_refs(self, blocks: Sequence[KVCacheBlock]) -> None: ...

    def on_evicted(self, block: KVCacheBlock, block_hash: BlockHash) -> None: ...

    def on_cached(self, block: KVCacheBlock, block_hash: BlockHash,
                  parent_hash: BlockHash | None) -> None: ...

    def on_uncached(self, blocks: Sequence[KVCacheBlock]) -> None: ...

    def on_cleared(self) -> None: ...

    def on_pins(self, block_ids: Sequence[int], counts: Sequence[int]) -> None: ...


class BlockOpRecorder(BlockPoolObserver):
    """Records one pool's changes as ops tagged with `pool` (0 device, 1 host), appended to the
    shared `ops` list (several pools, one ordered stream). Op shapes (flat int lists):

    - ["r", pool, [id, ref, id, ref, ...]]       ref counts now
    - ["e", pool, [id, ...]]                      hashes dropped by eviction (memory reused)
    - ["c", pool, [id, hash, parent, ...]]        cached (hash and parent are short hex or None)
    - ["u", pool, [id, ...]]                      hashes dropped by a reset that kept pins
    - ["x", pool, []]                             every hash dropped
    - ["p", pool, [id, count, ...]]               pinned-prefix counts (0: unpinned)
    - ["o", pool, [id, ...]]                      the cached free blocks in eviction order
                                                  (`order_op`; appended by the feed, not here)
    """

    __slots__ = ("ops", "pool")

    def __init__(self, ops: list[list[Any]], pool: int) -> None:
        self.ops = ops
        self.pool = pool

    def on_refs(self, blocks: Sequence[KVCacheBlock]) -> None:
        flat: list[int] = []
        for block in blocks:
            flat += (block.block_id, block.ref_cnt)
        if flat:
            self.ops.append(["r", self.pool, flat])

    def on_evicted(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        self.ops.append(["e", self.pool, [block.block_id]])

    def on_cached(self, block: KVCacheBlock, block_hash: BlockHash,
                  parent_hash: BlockHash | None) -> None:
        self.ops.append(["c", self.pool, [block.block_id, short_hash(block_hash),
                                          short_hash(parent_hash)]])

    def on_uncached(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.ops.append(["u", self.pool, [b.block_id for b in blocks]])

    def on_cleared(self) -> None:
        self.ops.append(["x", self.pool, []])

    def on_pins(self, block_ids: Sequence[int], counts: Sequence[int]) -> None:
        flat: list[int] = []
        for block_id, count in zip(block_ids, counts, strict=True):
            flat += (block_id, count)
        if flat:
            self.ops.append(["p", self.pool, flat])


def pool_snapshot(pool: ObservedPool, pin_counts: dict[int, int] | None = None) -> dict[str, Any]:
    """The pool's block state in the shape the op stream rebuilds: `refs` and `hashes` per
    block id (block 0, the null block, included), `free_order` (the free blocks that carry a
    hash, next to be evicted first, in the policy's exact order) and
    `pins` ({block_id: count}). O(num_blocks); a new object the caller owns."""
    blocks = pool.blocks
    return {
        "num_blocks": pool.num_blocks,
        "refs": [b.ref_cnt for b in blocks],
        "hashes": [short_hash(b.block_hash) for b in blocks],
        "free_order": eviction_order(pool),
        "pins": dict(pin_counts or {}),
    }


def eviction_order(pool: ObservedPool) -> list[int]:
    """The ids of the pool's cached free blocks (evictable), the next evicted first, in the
    exact order of its eviction policy. O(free blocks)."""
    return [b.block_id for b in pool.eviction.eviction_order() if b.block_hash is not None]


def order_op(pool: ObservedPool, index: int) -> list[Any]:
    """The "o" op of pool `index` (0 device, 1 host): its `eviction_order` now."""
    return ["o", index, eviction_order(pool)]
