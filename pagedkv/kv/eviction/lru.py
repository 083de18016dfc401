"""LRU eviction: a free queue whose head is reused first.

- A freed block WITH a hash is appended at the tail: cached blocks are evicted in the order
  they were freed (least recently used first), and since callers free tail first, a request's
  prefix blocks are evicted after its tail blocks.
- A freed block WITHOUT a hash goes to the HEAD, so unhashed memory is reused before any cached
  block is evicted.
- A hit takes a free block out of the middle of the queue.

One intrusive doubly linked list (`FreeBlockQueue`: the links live in the blocks themselves)
makes each of these O(1) per block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from pagedkv.kv.block import KVCacheBlock
from pagedkv.kv.eviction.base import EvictionPolicy


class FreeBlockQueue:
    """Doubly linked list of free blocks with fake head and tail sentinels.

    `blocks` are linked in the given order. A block is in the queue iff its `prev_free_block`
    is not None (the sentinels guarantee both links are set for members). `num_free_blocks` is
    kept up to date, so the length is O(1).
    """

    __slots__ = ("num_free_blocks", "fake_head", "fake_tail")

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = 0
        self.fake_head = KVCacheBlock(-1)
        self.fake_tail = KVCacheBlock(-1)
        self.fake_head.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = self.fake_head
        self.append_n(blocks)

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first n blocks in queue order. Raises ValueError if n > length."""
        if n > self.num_free_blocks or n < 0:
            raise ValueError(f"cannot pop {n} blocks from a queue of {self.num_free_blocks}")
        if n == 0:
            return []
        out = [None] * n
        block = self.fake_head.next_free_block
        for i in range(n):
            out[i] = block
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        self.fake_head.next_free_block = block
        block.prev_free_block = self.fake_head
        self.num_free_blocks -= n
        return out  # type: ignore[return-value]

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append `blocks` at the tail in the given order (the last one is reused last)."""
        tail = self.fake_tail
        last = tail.prev_free_block
        n = 0
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
            n += 1
        last.next_free_block = tail
        tail.prev_free_block = last
        self.num_free_blocks += n

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from the middle of the queue. Raises ValueError if it is not queued."""
        prev = block.prev_free_block
        nxt = block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All queued blocks, head first (O(n); for tests and invariant checks)."""
        out = []
        block = self.fake_head.next_free_block
        tail = self.fake_tail
        while block is not tail:
            out.append(block)
            block = block.next_free_block
        return out

    def __len__(self) -> int:
        return self.num_free_blocks

    def check_links(self, fail: Callable[[str], None], name: str = "free queue") -> None:
        """Walk the list: links both ways, no cycle, length == num_free_blocks. O(n)."""
        seen: set[int] = set()
        prev = self.fake_head
        block = prev.next_free_block
        while block is not self.fake_tail:
            if block is None:
                fail(f"{name} is broken (a None link)")
            if id(block) in seen:
                fail(f"block {block.block_id} is twice in the {name} (a cycle)")
            if block.prev_free_block is not prev:
                fail(f"block {block.block_id} has a wrong prev link in the {name}")
            seen.add(id(block))
            prev, block = block, block.next_free_block
        if self.fake_tail.prev_free_block is not prev:
            fail(f"{name} tail link is wrong")
        if len(seen) != self.num_free_blocks:
            fail(f"{name}: num_free_blocks {self.num_free_blocks} != {len(seen)} blocks in it")


class LRUEvictionPolicy(FreeBlockQueue, EvictionPolicy):
    """Least recently freed cached block first; unhashed blocks before any cached one.

    The policy is the free queue itself (head reused first), so `num_free_blocks` is a plain
    attribute and `pop` is `popleft_n`: the pool's hot paths pay no extra indirection.
    """

    __slots__ = ()
    order_follows_frees = True

    def add(self, blocks: Sequence[KVCacheBlock]) -> None:
        head = self.fake_head
        tail = self.fake_tail
        for block in blocks:
            if block.block_hash is None:  # nothing reusable in it: reused first
                first = head.next_free_block
                head.next_free_block = block
                block.prev_free_block = head
                block.next_free_block = first
                first.prev_free_block = block
            else:  # cached: evicted after every block freed before it
                last = tail.prev_free_block
                last.next_free_block = block
                block.prev_free_block = last
                block.next_free_block = tail
                tail.prev_free_block = block
        self.num_free_blocks += len(blocks)

    def remove(self, blocks: Sequence[KVCacheBlock]) -> None:
        for block in blocks:
            if block.prev_free_block is None:
                raise ValueError(f"block {block.block_id} cannot be taken: it is the null "
                                 f"block or not in the free queue")
        unlink = FreeBlockQueue.remove
        for block in blocks:
            unlink(self, block)

    pop = FreeBlockQueue.popleft_n

    def free_blocks(self) -> list[KVCacheBlock]:
        return self.get_all_free_blocks()

    def check_invariants(self, fail: Callable[[str], None]) -> None:
        self.check_links(fail)
