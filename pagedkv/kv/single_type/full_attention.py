"""Full attention: every token attends to the whole prefix, so a table keeps all its blocks."""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.kv.block import KVCacheBlock
from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.single_type.base import BlockTablePolicy


class FullAttentionPolicy(BlockTablePolicy):
    def remove_skipped_blocks(self, pool: BlockPool, blocks: list[KVCacheBlock],
                              num_computed_tokens: int) -> None:
        return None  # nothing falls out of view

    def blocks_to_free(self, blocks: list[KVCacheBlock]) -> Iterable[KVCacheBlock]:
        return reversed(blocks)  # never holds the null block
