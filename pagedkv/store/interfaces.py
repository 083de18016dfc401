"""What the KV store needs of the engine's other parts, as Protocols: a request, a step's
scheduled requests, the KV cache's block rows and a tensor-parallel group. The scheduler's
`Request` and `SchedulerOutput`, the model's `KVCache` and `TensorParallelGroup` satisfy them
(so do the simulator's); the store never imports those: it sits below the scheduler and the
model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class StoreRequest(Protocol):
    """A request as the store reads it: its tokens (prompt and output), what its block hashes
    carry besides them, and the cached answer of its last store lookup
    (`(first block, blocks held)`, set and read by `lookup.store_matched_tokens`)."""

    request_id: str
    cache_salt: str | None
    lora_name: str | None
    all_token_ids: list[int]
    kv_store_lookup: tuple[int, int] | None

    @property
    def num_tokens(self) -> int: ...


class ScheduledBlocks(Protocol):
    """One request of a step: the tokens it computes from `start_pos` and its block tables
    (`group_block_tables`: each KV cache group's, None with one group)."""

    request_id: str
    start_pos: int
    block_table: list[int]
    group_block_tables: list[list[int]] | None

    @property
    def num_new_tokens(self) -> int: ...


class ScheduledStep(Protocol):
    """A step as the store's scheduler side reads it: the requests it runs."""

    scheduled: Sequence[ScheduledBlocks]


class BlockRows(Protocol):
    """A KV cache seen as rows of raw bytes, one a block (the cache owns its layout)."""

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor: ...

    def write_blocks(self, block_ids: list[int], rows: torch.Tensor) -> None: ...


class RankGroup(Protocol):
    """A tensor-parallel group as a rank's store sees it."""

    rank: int
    size: int

    @property
    def is_driver(self) -> bool: ...

    def all_gather_objects(self, obj: Any) -> list[Any]: ...
