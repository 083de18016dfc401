"""BlockPool: the allocator of physical KV blocks, with a lazily evicted prefix cache.

Every block is in exactly one of two states: in use (ref_cnt > 0, held by block tables) or
free (ref_cnt == 0, held by the eviction policy). A free block may still be registered in the
prefix cache under its hash: it is evicted only when `get_new_blocks` hands its memory out
again (lazy eviction), and until then a cache hit can `touch` it back into use.

Which free block is reused next is the eviction policy's business (`pagedkv.kv.eviction`):
LRU by default (least recently freed cached block first, unhashed blocks before any cached
one). Callers free a request's blocks tail first, so its prefix blocks (the most shareable)
survive longest under LRU.

Block 0 is the null block: a placeholder in block tables (sliding-window slots that were
freed). It is never allocated, never freed and never in the free queue.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence

from pagedkv.kv.block import KVCacheBlock
from pagedkv.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from pagedkv.kv.eviction import EvictionPolicy, LRUEvictionPolicy, eviction_policy_class
from pagedkv.kv.eviction_log import EvictionLog
from pagedkv.kv.hashing import BlockHash, event_extra_keys, split_group_key
from pagedkv.kv.observer import BlockPoolObserver


def host_pool_num_blocks(num_host_blocks: int) -> int:
    """Physical host blocks behind `num_host_blocks` usable swap blocks: the null block 0 plus
    those, or none at all without swap. The one number that sizes both the host `BlockPool`
    (which hands out ids 1..num_host_blocks) and the runner's host KV tensor."""
    return num_host_blocks + 1 if num_host_blocks > 0 else 0


class BlockPool:
    """`num_blocks` physical blocks, block 0 reserved as the null block.

    `eviction_policy` builds the policy from the usable blocks (all free at the start, in id
    order): a name in `pagedkv.kv.eviction.EVICTION_POLICIES` (ValueError otherwise), a
    callable, or None for LRU.
    """

    def __init__(self, num_blocks: int, enable_caching: bool,
                 enable_kv_cache_events: bool = False,
                 eviction_policy: str | Callable[[list[KVCacheBlock]], EvictionPolicy] | None
                 = None) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks must be an int >= 2 (block 0 is the null block), "
                             f"got {num_blocks!r}")
        if isinstance(eviction_policy, str):
            eviction_policy = eviction_policy_class(eviction_policy)
        self.num_blocks = num_blocks
        self.num_usable_blocks = num_blocks - 1
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.eviction: EvictionPolicy = (eviction_policy or LRUEvictionPolicy)(self.blocks[1:])
        self._records_access = (type(self.eviction).record_access
                                is not EvictionPolicy.record_access)
        # hash -> the one block registered under it (a block's block_hash is set iff it is here).
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.events: list[KVCacheEvent] = []
        self.num_evicted_blocks = 0  # cached blocks whose hash was dropped to reuse them
        # Block-level watchers (the dashboard): None unless someone watches, see kv/observer.py.
        self.observer: BlockPoolObserver | None = None
        # Evicted hashes, for "why did this miss?" (kv/eviction_log.py); set by the KV manager.
        self.eviction_log: EvictionLog | None = None
        # Keys cached without events (partial blocks of sub-block prefix hits, partial_hits.py).
        self._untracked: set[BlockHash] = set()

    # ------------------------------------------------------------------ allocation
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take the `num_blocks` blocks the eviction policy reuses next, each with ref_cnt 1.

        A taken block that is still cached is evicted now (hash dropped, BlockRemoved event).
        Raises ValueError when fewer blocks are free. The list is the caller's.
        """
        num_free = self.eviction.num_free_blocks
        if num_blocks > num_free:
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {num_free} free")
        blocks = self.eviction.pop(num_blocks)
        if self.enable_caching:
            for block in blocks:
                if block.block_hash is not None:
                    self._evict(block)
                block.ref_cnt = 1
        else:
            for block in blocks:
                block.ref_cnt = 1
        if self.observer is not None:
            self.observer.on_refs(blocks)
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        del self.cached_block_hash_to_block[block_hash]
        block.block_hash = None
        self.num_evicted_blocks += 1
        if self._untracked and block_hash in self._untracked:
            self._untracked.discard(block_hash)
            return
        if self.enable_kv_cache_events:
            plain, group_idx = split_group_key(block_hash)
            self.events.append(BlockRemoved([plain], group_idx=group_idx))
        if self.eviction_log is not None:
            self.eviction_log.record(block_hash, block.block_id)
        if self.observer is not None:
            self.observer.on_evicted(block, block_hash)

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given (eviction) order: callers pass a
        request's blocks tail first.

        The blocks reaching ref_cnt 0 go to the eviction policy, in that order. Raises
        ValueError ("double free") for a block already at 0 or the null block; blocks before
        the bad one have been released by then.
        """
        observer = self.observer
        if observer is not None:
            blocks = list(blocks)
        freed: list[KVCacheBlock] = []
        append = freed.append
        try:
            for block in blocks:
                ref = block.ref_cnt
                if ref > 1:
                    block.ref_cnt = ref - 1
                    continue
                if ref != 1:  # the null block always has ref_cnt 0
                    raise ValueError(f"double free of block {block.block_id} (ref_cnt {ref}"
                                     f"{', null block' if block.is_null else ''})")
                block.ref_cnt = 0
                append(block)
        finally:
            if freed:
                self.eviction.add(freed)
            if observer is not None:
                observer.on_refs(blocks)  # in freeing order (the free order's order)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each block (a cache hit or a fork); a free one leaves the
        eviction policy's free set. Raises ValueError for the null block (blocks before it
        have been taken by then)."""
        observer = self.observer
        if (self._records_access or observer is not None) and not isinstance(blocks, list):
            blocks = list(blocks)
        taken = []
        try:
            for block in blocks:
                if block.ref_cnt == 0:
                    if block.is_null:
                        raise ValueError(f"block {block.block_id} cannot be touched: it is the "
                                         f"null block")
                    taken.append(block)
                block.ref_cnt += 1
        finally:
            if taken:
                self.eviction.remove(taken)
            if observer is not None:
                observer.on_refs(blocks)
        if self._records_access:
            self.eviction.record_access(blocks)

    # ------------------------------------------------------------------ prefix cache
    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block registered under `block_hash` (possibly free), or None."""
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int, block_size: int,
                          token_ids: Sequence[int] | None = None, *,
                          cache_salt: str | None = None, lora_name: str | None = None) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] under block_hashes[i].

        Skips null blocks and blocks that already carry a hash (prefix hits). When another block
        is already registered under the same hash (two requests computed the same prefix), the
        new block stays unhashed: it is reused first once freed. `token_ids` (the request's
        tokens), `cache_salt` and `lora_name` (the request's, as hashed) only for BlockStored
        events, whose `extra_keys` carry them as vLLM's do. Mutates the blocks' hashes, the
        cache map and the event queue.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        cache = self.cached_block_hash_to_block
        emit = self.enable_kv_cache_events
        stored: list[int] = []
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:
                continue
            block_hash = block_hashes[i]
            if block_hash in cache:
                continue
            block.block_hash = block_hash
            cache[block_hash] = block
            if emit:
                stored.append(i)
            if self.observer is not None:
                self.observer.on_cached(block, block_hash, block_hashes[i - 1] if i else None)
        if stored:
            self._emit_stored(stored, block_hashes, block_size, token_ids, cache_salt, lora_name)

    def cache_untracked(self, block: KVCacheBlock, key: BlockHash) -> None:
        """Register `block` (unhashed) under `key` with no event: a partial block offered to
        sub-block prefix hits (partial_hits.py); evicted like any cached block, silently."""
        if block.block_hash is not None or block.is_null or key in self.cached_block_hash_to_block:
            raise ValueError(f"block {block.block_id} cannot be cached under a new key")
        block.block_hash = key
        self.cached_block_hash_to_block[key] = block
        self._untracked.add(key)

    def _emit_stored(self, stored: list[int], block_hashes: Sequence[BlockHash],
                     block_size: int, token_ids: Sequence[int] | None,
                     cache_salt: str | None, lora_name: str | None) -> None:
        # One BlockStored per contiguous run, so each event is a chain off its parent.
        run = [stored[0]]
        for i in stored[1:] + [-1]:
            if i == run[-1] + 1:
                run.append(i)
                continue
            first, last = run[0], run[-1]
            tokens = ([] if token_ids is None
                      else list(token_ids[first * block_size:(last + 1) * block_size]))
            keys = [split_group_key(block_hashes[j]) for j in run]
            self.events.append(BlockStored(
                block_hashes=[h for h, _ in keys],
                parent_block_hash=split_group_key(block_hashes[first - 1])[0] if first > 0
                else None, token_ids=tokens, block_size=block_size, group_idx=keys[0][1],
                extra_keys=[event_extra_keys(cache_salt, lora_name, j == 0) for j in run]))
            run = [i]

    def reset_prefix_cache(self, keep: Collection[KVCacheBlock] = ()) -> bool:
        """Forget every cached hash but those of `keep` (distinct blocks the caller holds, e.g.
        pinned prefixes). Only when no other block is in use; returns whether it did."""
        if self.eviction.num_free_blocks != self.num_usable_blocks - len(keep):
            return False
        if keep:
            dropped = [h for h, b in self.cached_block_hash_to_block.items() if b not in keep]
            uncached = []
            for block_hash in dropped:
                block = self.cached_block_hash_to_block.pop(block_hash)
                block.block_hash = None
                uncached.append(block)
            if uncached and self.observer is not None:
                self.observer.on_uncached(uncached)
            dropped = [h for h in dropped if h not in self._untracked]
            self._untracked.clear()
            if dropped and self.enable_kv_cache_events:
                self.events.append(BlockRemoved(dropped))
            return True
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        self._untracked.clear()
        if self.enable_kv_cache_events:
            self.events.append(AllBlocksCleared())
        if self.observer is not None:
            self.observer.on_cleared()
        return True

    # ------------------------------------------------------------------ stats
    def get_num_free_blocks(self) -> int:
        """Free blocks (cached blocks that no request holds count as free). O(1)."""
        return self.eviction.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks held by block tables."""
        return 1.0 - self.eviction.num_free_blocks / self.num_usable_blocks

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the events emitted since the last call (always [] with events disabled)."""
        events, self.events = self.events, []
        return events

    # ------------------------------------------------------------------ checking
    def check_invariants(self, block_tables: Iterable[Sequence[KVCacheBlock]] | None = None,
                         ) -> None:
        """Raise RuntimeError naming the first violated invariant. O(num_blocks)."""
        def fail(msg: str) -> None:
            raise RuntimeError(f"BlockPool invariant violated: {msg}")

        null = self.null_block
        if not null.is_null or null.ref_cnt != 0 or null.block_hash is not None:
            fail(f"null block changed: {null!r}")
        if null.prev_free_block is not None or null.next_free_block is not None:
            fail("null block is linked into the free queue")
        self.eviction.check_invariants(fail)
        seen: set[int] = set()
        for block in self.eviction.free_blocks():
            if block.block_id in seen:
                fail(f"block {block.block_id} is twice in the free set")
            if block.ref_cnt != 0:
                fail(f"block {block.block_id} is free with ref_cnt {block.ref_cnt}")
            if self.blocks[block.block_id] is not block:
                fail(f"foreign block {block.block_id} in the free set")
            seen.add(block.block_id)
        if len(seen) != self.eviction.num_free_blocks:
            fail(f"num_free_blocks {self.eviction.num_free_blocks} != {len(seen)} free blocks")
        in_use = 0
        for block in self.blocks[1:]:
            if block.ref_cnt < 0:
                fail(f"block {block.block_id} has ref_cnt {block.ref_cnt}")
            if block.ref_cnt > 0:
                in_use += 1
                if block.block_id in seen:
                    fail(f"block {block.block_id} is in use but in the free set")
            elif block.block_id not in seen:
                fail(f"block {block.block_id} has ref_cnt 0 but is not in the free queue")
            if block.block_hash is not None and \
                    self.cached_block_hash_to_block.get(block.block_hash) is not block:
                fail(f"block {block.block_id} has a hash that does not map back to it")
        if len(seen) + in_use != self.num_usable_blocks:
            fail(f"free {len(seen)} + in use {in_use} != usable {self.num_usable_blocks}")
        if self.cached_block_hash_to_block and not self.enable_caching:
            fail("blocks are cached with caching disabled")
        for block_hash, block in self.cached_block_hash_to_block.items():
            if block.block_hash != block_hash:
                fail(f"hash {block_hash.hex()[:16]} maps to block {block.block_id} holding "
                     f"{None if block.block_hash is None else block.block_hash.hex()[:16]}")
        if block_tables is not None:
            counts = [0] * self.num_blocks
            for table in block_tables:
                for block in table:
                    if self.blocks[block.block_id] is not block:
                        fail(f"a block table holds foreign block {block.block_id}")
                    counts[block.block_id] += 1
            for block in self.blocks[1:]:
                if block.ref_cnt != counts[block.block_id]:
                    fail(f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
                         f"{counts[block.block_id]} block-table references")
