"""Physical KV blocks and the free queue that orders them for reuse.

A `KVCacheBlock` is a handle for one physical block of KV memory: its id (the index into the
runner's KV tensors), its reference count (how many block tables hold it) and, once it is full
and registered in the prefix cache, the hash of its contents. Blocks are preallocated by the
`BlockPool` and never created or destroyed afterwards.

`FreeBlockQueue` is an intrusive doubly linked list (the links live in the blocks themselves) in
eviction order: the head is reused first, the tail last. Every operation the pool needs is O(1)
per block: pop from the head, append at the tail, push at the head, and removal from the middle
(a prefix-cache hit takes a free block back into use).
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.kv.hashing import BlockHash


class KVCacheBlock:
    """One physical KV block. Mutated only by `BlockPool` and `FreeBlockQueue`."""

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


class FreeBlockQueue:
    """Doubly linked list of free blocks with fake head and tail sentinels.

    `blocks` are linked in the given order. A block is in the queue iff its `prev_free_block`
    is not None (the sentinels guarantee both links are set for members). `num_free_blocks` is
    kept up to date, so the length is O(1).
    """

    __slots__ = ("num_free_blocks", "fake_head", "fake_tail")

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_head = KVCacheBlock(-1)
        self.fake_tail = KVCacheBlock(-1)
        prev = self.fake_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block. Raises ValueError when the queue is empty."""
        block = self.fake_head.next_free_block
        if block is self.fake_tail:
            raise ValueError("no free blocks left: popleft on an empty FreeBlockQueue")
        nxt = block.next_free_block
        self.fake_head.next_free_block = nxt
        nxt.prev_free_block = self.fake_head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

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

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail (reused last)."""
        tail = self.fake_tail
        last = tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = tail
        tail.prev_free_block = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put `block` at the head (reused first)."""
        head = self.fake_head
        first = head.next_free_block
        head.next_free_block = block
        block.prev_free_block = head
        block.next_free_block = first
        first.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append `blocks` at the tail in the given order."""
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
