"""Incremental block tables: a request's device block table (`BlockList`) and a copy of its
block ids kept up to date at the cost of the blocks appended since (`BlockIdTable`).

The model runner reads every scheduled request's block ids each step. Rebuilding them costs
O(blocks) per request per step; a decode step appends a block only every `block_size` steps and
rewrites entries rarely (copy-on-write, the sliding window's null block, a trim). `BlockList`
counts those rewrites itself (any change but an append), so nothing that edits a table has to
remember to report it; a `BlockIdTable` that finds the same list with the same count only
appends the ids of the new blocks, and rebuilds itself otherwise (another list: a swap, a
re-admission, a fork; or a rewrite).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, SupportsIndex

from pagedkv.kv.block import KVCacheBlock


class BlockList(list):
    """A list of KVCacheBlock that counts its rewrites: `rewrites` grows on every change that
    is not an append at the end (append, extend and += leave it alone). Behaves as a list."""

    __slots__ = ("rewrites",)

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        super().__init__(blocks)
        self.rewrites = 0

    def __setitem__(self, index: Any, value: Any) -> None:
        self.rewrites += 1
        super().__setitem__(index, value)

    def __delitem__(self, index: Any) -> None:
        self.rewrites += 1
        super().__delitem__(index)

    def __imul__(self, n: SupportsIndex) -> BlockList:
        self.rewrites += 1
        return super().__imul__(n)

    def insert(self, index: SupportsIndex, value: KVCacheBlock) -> None:
        self.rewrites += 1
        super().insert(index, value)

    def pop(self, index: SupportsIndex = -1) -> KVCacheBlock:
        self.rewrites += 1
        return super().pop(index)

    def remove(self, value: KVCacheBlock) -> None:
        self.rewrites += 1
        super().remove(value)

    def clear(self) -> None:
        self.rewrites += 1
        super().clear()

    def reverse(self) -> None:
        self.rewrites += 1
        super().reverse()

    def sort(self, *args: Any, **kwargs: Any) -> None:
        self.rewrites += 1
        super().sort(*args, **kwargs)


class BlockIdTable:
    """`ids`: the block ids of the table last passed to `sync` (the null block's as 0). The
    list object stays the same across syncs (its owner hands it to the runner)."""

    __slots__ = ("ids", "_source", "_rewrites")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self._source: BlockList | None = None
        self._rewrites = 0

    def sync(self, blocks: list[KVCacheBlock]) -> list[int]:
        """Make `ids` the ids of `blocks` and return it (mutated in place): O(blocks appended
        since the last sync) when `blocks` is the same BlockList with no rewrite since, else
        O(blocks)."""
        ids = self.ids
        n = len(ids)
        if blocks is self._source and blocks.rewrites == self._rewrites and n <= len(blocks):
            if n < len(blocks):
                ids.extend([b.block_id for b in blocks[n:]])
            return ids
        ids[:] = [b.block_id for b in blocks]
        if type(blocks) is BlockList:
            self._source, self._rewrites = blocks, blocks.rewrites
        else:  # a plain list cannot tell its rewrites: rebuilt every time
            self._source = None
        return ids
