"""Sliding window: a token at position p attends to p - W + 1 .. p, so blocks wholly before the
window of the next token to compute are freed (and nulled in the table) as the sequence grows;
a sequence holds at most cdiv(W, block_size) + 1 blocks."""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.kv.block import KVCacheBlock
from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.single_type.base import BlockTablePolicy


class SlidingWindowPolicy(BlockTablePolicy):
    frees_skipped_blocks = True

    def __init__(self, block_size: int, sliding_window: int) -> None:
        super().__init__(block_size)
        if not isinstance(sliding_window, int) or sliding_window <= 0:
            raise ValueError(f"sliding_window must be a positive int, got {sliding_window!r}")
        self.sliding_window = sliding_window

    def remove_skipped_blocks(self, pool: BlockPool, blocks: list[KVCacheBlock],
                              num_computed_tokens: int) -> None:
        num_skipped = num_computed_tokens - self.sliding_window + 1
        if num_skipped <= 0:
            return
        null = pool.null_block
        removed = []
        for i in range(min(num_skipped // self.block_size, len(blocks)) - 1, -1, -1):
            block = blocks[i]
            if block.is_null:
                break  # everything before it was nulled earlier
            removed.append(block)
            blocks[i] = null
        if removed:
            pool.free_blocks(removed)

    def blocks_to_free(self, blocks: list[KVCacheBlock]) -> Iterable[KVCacheBlock]:
        return [b for b in reversed(blocks) if not b.is_null]
