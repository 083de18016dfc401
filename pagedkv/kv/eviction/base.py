"""EvictionPolicy: which free KV block the pool hands out (and so evicts from the cache) next.

Division of labour with `BlockPool`:
- the pool owns every block's `ref_cnt`, the prefix-cache map (`block_hash`) and the events; it
  tells the policy when a block becomes free (ref_cnt reached 0) and when a free block is taken
  back into use, and asks it for the next blocks to reuse;
- the policy owns only the set of free blocks and their order. It may keep its own structures
  and may use the `prev_free_block` / `next_free_block` slots of the blocks it holds (they are
  reserved for the policy); it never changes `ref_cnt` or `block_hash`.

The free set always holds exactly the blocks with ref_cnt 0, the null block excepted. A free
block may still carry a hash (it is still in the prefix cache, lazily evicted): when `pop`
hands it out, the pool drops its hash. So the order decides which cached prefixes survive.

Rules every policy must keep:
- `add` receives blocks in the caller's freeing order, and callers free a request's blocks
  TAIL FIRST (last block first): a policy that evicts oldest-first therefore evicts a request's
  tail before its prefix, which is the part other requests can share. Blocks without a hash
  (partial, or duplicates of a cached block) hold nothing reusable; they should be reused first.
- `add`, `remove` and `pop` are on every scheduling step's hot path: O(1) per block (amortised),
  no scan of the free set. `num_free_blocks` is O(1).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from pagedkv.kv.block import KVCacheBlock


def check_all_free(blocks: Sequence[KVCacheBlock], state: Sequence[int], not_free: int) -> None:
    """For `remove`: ValueError (before anything changes) unless every block's
    `state[block_id]` (a policy's per-block record) says it is free."""
    for block in blocks:
        if block.block_id >= len(state) or state[block.block_id] == not_free:
            raise ValueError(f"block {block.block_id} cannot be taken: it is the null block or "
                             f"not free")


class EvictionPolicy(ABC):
    """The order in which free blocks are reused. See the module docstring for the contract."""

    # How many blocks are free: an attribute (or property) read on every allocation, O(1).
    num_free_blocks: int
    # True when the free order is the freeing order (unhashed blocks first): a watcher can
    # rebuild it from the ref-count changes alone (the dashboard). False: ask `eviction_order`.
    order_follows_frees: bool = False

    @abstractmethod
    def add(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take `blocks`, whose ref_cnt just reached 0, into the free set (freeing order, tail
        first). Mutates the free set and the blocks' free-list links."""

    @abstractmethod
    def remove(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take free `blocks` out of the free set: a prefix-cache hit or a fork is about to use
        them (ref_cnt is still 0). Raises ValueError, changing nothing, when one is not free."""

    @abstractmethod
    def pop(self, num_blocks: int) -> list[KVCacheBlock]:
        """Remove and return the `num_blocks` blocks to reuse next (the pool then evicts their
        hashes). Raises ValueError when fewer are free."""

    def record_access(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Every block a hit or a fork takes a reference on, free or in use, after `remove`.
        For policies that count accesses (LFU). The pool calls it only when a subclass
        overrides it, so LRU (recency is the free order) pays nothing for it."""
        del blocks

    @abstractmethod
    def free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, the next to be reused first. O(n): for tests and invariant checks."""

    def eviction_order(self) -> list[KVCacheBlock]:
        """Every free block in the exact order `pop` would hand them out now (one `pop(n)` or
        n `pop(1)`s alike), the next first. O(n), mutates nothing. By default `free_blocks()`;
        a policy whose `free_blocks` is not that order overrides this."""
        return self.free_blocks()

    def check_invariants(self, fail: Callable[[str], None]) -> None:
        """Check the policy's own structure, calling `fail(message)` on the first violation.
        The pool checks the membership (exactly the ref_cnt 0 blocks) itself."""
        del fail
