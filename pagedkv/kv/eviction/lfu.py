"""LFU eviction: the free cached block used by the fewest requests goes first.

How a block's use is counted (its frequency):
- allocation (`pop`) starts a block's count at 1: the request that computes it is its first use;
- every prefix-cache hit and every fork on it (`record_access`) adds 1, whether the block was
  free or held by another request;
- along the chain a hit touches, a block never counts more than the block before it:
  `count[i] = min(count[i] + 1, count[i - 1])`. A hit on block i always hits blocks 0..i-1 too,
  so this only matters for a block whose prefix was recomputed into a new block (its count
  restarts at 1); it keeps every chain's counts non-increasing from its first block on;
- counts saturate at `MAX_COUNT` (255): beyond that, blocks are equally hot and go in freeing
  order. There is no aging: a block keeps its count until its memory is reused.

Eviction order: blocks without a hash (nothing reusable in them) first, then cached blocks by
count, lowest first; within one count, in freeing order (oldest first). Since a request's blocks
are freed tail first and a block counts at least as much as its successor, a request's tail is
evicted before its prefix, as under LRU.

Structure: one intrusive free list per count (bucket 0 holds the unhashed blocks) and a bitmask
of the non-empty buckets, so the lowest one is `mask & -mask`: add, remove and pop are O(1) per
block, no heap and no scan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedkv.kv.block import KVCacheBlock
from pagedkv.kv.eviction.base import EvictionPolicy, check_all_free
from pagedkv.kv.eviction.lru import FreeBlockQueue

MAX_COUNT = 255
_NOT_FREE = -1


class LFUEvictionPolicy(EvictionPolicy):
    """Least frequently used cached block first (see the module docstring)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        size = max((b.block_id for b in blocks), default=0) + 1
        self.counts = [0] * size  # block_id -> uses since its memory was last handed out
        self._bucket_of = [_NOT_FREE] * size  # block_id -> its bucket while free
        self._buckets = [FreeBlockQueue([]) for _ in range(MAX_COUNT + 1)]
        self._mask = 0  # bit b set iff bucket b is non-empty
        self.num_free_blocks = 0
        self.add(blocks)

    def add(self, blocks: Sequence[KVCacheBlock]) -> None:
        buckets = self._buckets
        bucket_of = self._bucket_of
        counts = self.counts
        mask = self._mask
        for block in blocks:
            bid = block.block_id
            b = 0 if block.block_hash is None else max(1, counts[bid])
            bucket_of[bid] = b
            tail = buckets[b].fake_tail
            last = tail.prev_free_block
            last.next_free_block = block
            block.prev_free_block = last
            block.next_free_block = tail
            tail.prev_free_block = block
            buckets[b].num_free_blocks += 1
            mask |= 1 << b
        self._mask = mask
        self.num_free_blocks += len(blocks)

    def remove(self, blocks: Sequence[KVCacheBlock]) -> None:
        bucket_of = self._bucket_of
        check_all_free(blocks, bucket_of, _NOT_FREE)
        for block in blocks:
            b = bucket_of[block.block_id]
            bucket_of[block.block_id] = _NOT_FREE
            queue = self._buckets[b]
            queue.remove(block)
            if not queue.num_free_blocks:
                self._mask &= ~(1 << b)
        self.num_free_blocks -= len(blocks)

    def pop(self, num_blocks: int) -> list[KVCacheBlock]:
        if not 0 <= num_blocks <= self.num_free_blocks:
            raise ValueError(f"cannot pop {num_blocks} blocks: {self.num_free_blocks} are free")
        out: list[KVCacheBlock] = []
        while len(out) < num_blocks:
            lowest = self._mask & -self._mask
            queue = self._buckets[lowest.bit_length() - 1]
            out += queue.popleft_n(min(num_blocks - len(out), queue.num_free_blocks))
            if not queue.num_free_blocks:
                self._mask ^= lowest
        bucket_of = self._bucket_of
        counts = self.counts
        for block in out:  # new contents: the allocating request is the first use
            bucket_of[block.block_id] = _NOT_FREE
            counts[block.block_id] = 1
        self.num_free_blocks -= num_blocks
        return out

    def record_access(self, blocks: Sequence[KVCacheBlock]) -> None:
        counts = self.counts
        ceiling = MAX_COUNT
        for block in blocks:
            bid = block.block_id
            count = counts[bid] + 1
            if count > ceiling:
                count = ceiling
            counts[bid] = ceiling = count

    def free_blocks(self) -> list[KVCacheBlock]:
        out: list[KVCacheBlock] = []
        for queue in self._buckets:
            out += queue.get_all_free_blocks()
        return out

    def check_invariants(self, fail: Callable[[str], None]) -> None:
        total = 0
        for b, queue in enumerate(self._buckets):
            queue.check_links(fail, f"LFU bucket {b}")
            if bool(queue.num_free_blocks) != bool(self._mask >> b & 1):
                fail(f"LFU bucket {b} has {queue.num_free_blocks} blocks but its mask bit is "
                     f"{self._mask >> b & 1}")
            for block in queue.get_all_free_blocks():
                if self._bucket_of[block.block_id] != b:
                    fail(f"block {block.block_id} is in LFU bucket {b} but recorded in "
                         f"{self._bucket_of[block.block_id]}")
                if b and b != max(1, self.counts[block.block_id]):
                    fail(f"block {block.block_id} with count {self.counts[block.block_id]} is "
                         f"in LFU bucket {b}")
            total += queue.num_free_blocks
        if total != self.num_free_blocks:
            fail(f"num_free_blocks {self.num_free_blocks} != {total} blocks in the LFU buckets")
        if self._mask >> (MAX_COUNT + 1):
            fail(f"LFU mask has bits beyond bucket {MAX_COUNT}")
