"""BlockTablePolicy: what one attention type does with the blocks of a request's table."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from pagedkv.kv.block import KVCacheBlock
from pagedkv.kv.block_pool import BlockPool


class BlockTablePolicy(ABC):
    """Stateless rules the KVCacheManager applies to every request's device block table."""

    sliding_window: int | None = None
    # Whether remove_skipped_blocks can ever free a block: when False the manager skips the
    # call on its hot path (one decode step per request per step).
    frees_skipped_blocks: bool = False

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    @abstractmethod
    def remove_skipped_blocks(self, pool: BlockPool, blocks: list[KVCacheBlock],
                              num_computed_tokens: int) -> None:
        """Free the blocks no future token will attend to once `num_computed_tokens` tokens
        are computed, replacing them by the null block in `blocks` (mutated in place, so the
        table keeps its length and position p stays in blocks[p // block_size])."""

    @abstractmethod
    def blocks_to_free(self, blocks: list[KVCacheBlock]) -> Iterable[KVCacheBlock]:
        """The blocks of a finished table to hand back to the pool, tail first (so the prefix,
        the most shareable part, is freed last and evicted last)."""
