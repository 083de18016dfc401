"""ARC eviction (adaptive replacement cache, Megiddo and Modha; vLLM uses it for CPU offloading),
applied to the free cached blocks of the pool.

Lists (each an intrusive free list, least recently freed first):
- U: free blocks without a hash (nothing reusable in them): always reused first;
- T1: free cached blocks used once (only by the request that computed them);
- T2: free cached blocks used at least twice (a prefix-cache hit or a fork took them since
  their memory was handed out; `record_access`), or recomputed after ARC evicted them;
- ghosts B1 / B2: hashes of the blocks most recently evicted from T1 / T2 (at most as many as
  the pool has blocks each), remembered without memory.

The target `p` (0 <= p <= number of blocks) is how many free blocks T1 deserves. A freed block
whose hash is in B1 was evicted from T1 too soon (recency pays): p grows by
max(1, |B2| / |B1|); one in B2 was evicted from T2 too soon (frequency pays): p shrinks by
max(1, |B1| / |B2|). Either way the block joins T2 (it has now been used twice) and leaves the
ghost list. ARC sees such a "ghost hit" when the recomputed block is freed, not when the lookup
missed: the pool tells the policy nothing about misses.

Which block goes next (`pop`): U first; then, when T1 holds more than p blocks (or T2 is empty),
T1's least recently freed block (scan resistance: one-off prompts never push out the blocks
used twice); otherwise (recency wins) the least recently freed of T1's and T2's heads, i.e.
plain LRU over both. Its hash goes to B1 or B2.

Tail first: a request frees its blocks tail first, and a hit on a block is a hit on every block
before it in the chain, so a block is "used twice" only if its prefix is too. Within one freed
batch this is enforced (a block joins T2 only if the next block toward the head of the batch
does), since a ghost hit could otherwise promote a tail alone. So within each list a tail is
older than its prefix, a tail in T2 implies its prefix in T2, and T2 is only taken from when its
head is older than T1's: a request's tail is always evicted before its prefix.

add, remove and pop are O(1) per block (ghost lists are ordered dicts).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from pagedkv.kv.block import KVCacheBlock
from pagedkv.kv.eviction.base import EvictionPolicy, check_all_free
from pagedkv.kv.eviction.lru import FreeBlockQueue
from pagedkv.kv.hashing import BlockHash

# Which list a block is in (its tag); _NOT_FREE while a request holds it.
_NOT_FREE, _U, _T1, _T2 = 0, 1, 2, 3


class ARCEvictionPolicy(EvictionPolicy):
    """Adaptive replacement between recency (T1) and frequency (T2); see the module docstring."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        size = max((b.block_id for b in blocks), default=0) + 1
        self.capacity = len(blocks)
        self.p = 0.0  # target number of free T1 blocks
        self._lists = {_U: FreeBlockQueue([]), _T1: FreeBlockQueue([]), _T2: FreeBlockQueue([])}
        self._tag = [_NOT_FREE] * size
        self._used_twice = [False] * size  # a hit or fork took it since it was handed out
        self._freed_at = [0] * size  # freeing sequence number, to compare T1's and T2's heads
        self._clock = 0
        self.ghosts: dict[int, OrderedDict[BlockHash, None]] = {
            _T1: OrderedDict(), _T2: OrderedDict()}  # B1, B2
        self.num_free_blocks = 0
        self.add(blocks)

    @property
    def t1_size(self) -> int:
        return self._lists[_T1].num_free_blocks

    @property
    def t2_size(self) -> int:
        return self._lists[_T2].num_free_blocks

    # ------------------------------------------------------------------ free set
    def _ghost_hit(self, key: BlockHash) -> bool:
        """If `key` is in a ghost list: adapt p, forget it there, and say so."""
        b1, b2 = self.ghosts[_T1], self.ghosts[_T2]
        if key in b1:
            del b1[key]
            self.p = min(self.p + max(1.0, len(b2) / (len(b1) + 1)), float(self.capacity))
            return True
        if key in b2:
            del b2[key]
            self.p = max(self.p - max(1.0, len(b1) / (len(b2) + 1)), 0.0)
            return True
        return False

    def add(self, blocks: Sequence[KVCacheBlock]) -> None:
        # Decide head first (the batch is tail first): T2 only if the head-ward block is T2.
        n = len(blocks)
        tags = [_U] * n
        head_in_t2 = True
        used_twice = self._used_twice
        b1, b2 = self.ghosts[_T1], self.ghosts[_T2]
        for i in range(n - 1, -1, -1):
            block = blocks[i]
            key = block.block_hash
            if key is None:
                continue
            ghost_hit = (key in b1 or key in b2) and self._ghost_hit(key)
            head_in_t2 = head_in_t2 and (ghost_hit or used_twice[block.block_id])
            tags[i] = _T2 if head_in_t2 else _T1
        lists = self._lists
        tag_of = self._tag
        freed_at = self._freed_at
        clock = self._clock
        for block, tag in zip(blocks, tags, strict=True):
            bid = block.block_id
            tag_of[bid] = tag
            clock += 1
            freed_at[bid] = clock
            queue = lists[tag]
            tail = queue.fake_tail
            last = tail.prev_free_block
            last.next_free_block = block
            block.prev_free_block = last
            block.next_free_block = tail
            tail.prev_free_block = block
            queue.num_free_blocks += 1
        self._clock = clock
        self.num_free_blocks += n

    def remove(self, blocks: Sequence[KVCacheBlock]) -> None:
        tag = self._tag
        check_all_free(blocks, tag, _NOT_FREE)
        for block in blocks:
            self._lists[tag[block.block_id]].remove(block)
            tag[block.block_id] = _NOT_FREE
        self.num_free_blocks -= len(blocks)

    def _next_run(self, need: int) -> tuple[int, int]:
        """(list, how many) to evict next: its head, and as many after it as the same rule
        would pick one at a time (U is handled by the caller)."""
        t1, t2 = self._lists[_T1], self._lists[_T2]
        n1, n2 = t1.num_free_blocks, t2.num_free_blocks
        if not n2:
            return _T1, min(need, n1)
        if not n1:
            return _T2, min(need, n2)
        if n1 > self.p:  # T1 stays above p for the next n1 - floor(p) evictions
            return _T1, min(need, n1 - int(self.p))
        freed_at = self._freed_at
        return (_T1 if freed_at[t1.fake_head.next_free_block.block_id]
                < freed_at[t2.fake_head.next_free_block.block_id] else _T2), 1

    def pop(self, num_blocks: int) -> list[KVCacheBlock]:
        if not 0 <= num_blocks <= self.num_free_blocks:
            raise ValueError(f"cannot pop {num_blocks} blocks: {self.num_free_blocks} are free")
        unhashed = self._lists[_U]
        out = unhashed.popleft_n(min(num_blocks, unhashed.num_free_blocks))
        capacity = self.capacity
        while len(out) < num_blocks:
            tag, count = self._next_run(num_blocks - len(out))
            victims = self._lists[tag].popleft_n(count)
            ghosts = self.ghosts[tag]
            for block in victims:
                if block.block_hash is not None:  # reset_prefix_cache may have dropped it
                    ghosts[block.block_hash] = None
            while len(ghosts) > capacity:
                ghosts.popitem(last=False)
            out += victims
        tags = self._tag
        used_twice = self._used_twice
        for block in out:  # new contents: not used twice yet
            tags[block.block_id] = _NOT_FREE
            used_twice[block.block_id] = False
        self.num_free_blocks -= num_blocks
        return out

    def record_access(self, blocks: Sequence[KVCacheBlock]) -> None:
        used_twice = self._used_twice
        for block in blocks:
            used_twice[block.block_id] = True

    def free_blocks(self) -> list[KVCacheBlock]:
        """U, then T1 and T2 (not the eviction order: see `eviction_order`)."""
        return [b for tag in (_U, _T1, _T2) for b in self._lists[tag].get_all_free_blocks()]

    def eviction_order(self) -> list[KVCacheBlock]:
        """U, then T1 and T2 merged by `pop`'s rule (p only changes when blocks are freed, so
        it holds through a run of pops)."""
        t1 = self._lists[_T1].get_all_free_blocks()
        t2 = self._lists[_T2].get_all_free_blocks()
        out = self._lists[_U].get_all_free_blocks()
        freed_at = self._freed_at
        i = j = 0
        while i < len(t1) or j < len(t2):
            n1, n2 = len(t1) - i, len(t2) - j
            take_t1 = (not n2 or (n1 and (n1 > self.p or
                                          freed_at[t1[i].block_id] < freed_at[t2[j].block_id])))
            if take_t1:
                out.append(t1[i])
                i += 1
            else:
                out.append(t2[j])
                j += 1
        return out

    def check_invariants(self, fail: Callable[[str], None]) -> None:
        total = 0
        for tag, queue in self._lists.items():
            name = {_U: "ARC list U", _T1: "ARC list T1", _T2: "ARC list T2"}[tag]
            queue.check_links(fail, name)
            last = -1
            for block in queue.get_all_free_blocks():
                if self._tag[block.block_id] != tag:
                    fail(f"block {block.block_id} is in {name} but tagged {self._tag[block.block_id]}")
                if tag != _U and self._freed_at[block.block_id] <= last:
                    fail(f"{name} is not in freeing order at block {block.block_id}")
                last = self._freed_at[block.block_id]
            total += queue.num_free_blocks
        if total != self.num_free_blocks:
            fail(f"num_free_blocks {self.num_free_blocks} != {total} blocks in the ARC lists")
        if not 0.0 <= self.p <= self.capacity:
            fail(f"ARC target p={self.p} outside [0, {self.capacity}]")
        for tag, ghosts in self.ghosts.items():
            if len(ghosts) > self.capacity:
                fail(f"ARC ghost list B{tag - 1} holds {len(ghosts)} > {self.capacity} hashes")
