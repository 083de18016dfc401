"""What the KV cache manager keeps and answers per request: the request it reads (`KVRequest`),
its block state (`RequestBlocks`), the admission answer (`AllocStatus`), the prefix-cache
counters and the recent prompts kept for explaining misses. Types only (manager.py acts)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from pagedkv.kv.block import KVCacheBlock
from pagedkv.kv.block_table import BlockList
from pagedkv.kv.hashing import BlockHash


class AllocStatus(enum.Enum):
    """Admission answer of `can_allocate`: whether a request's whole sequence fits."""

    OK = enum.auto()  # fits now, keeping the watermark free
    LATER = enum.auto()  # does not fit now, but would fit in an otherwise empty pool
    NEVER = enum.auto()  # can never fit, even with the whole pool


class KVRequest(Protocol):
    """What the manager reads from a request (pagedkv.sched.Request satisfies it)."""

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    cache_salt: str | None
    lora_name: str | None

    @property
    def num_tokens(self) -> int: ...


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache counters, in tokens as vLLM counts them."""

    requests: int = 0  # get_computed_blocks calls
    queries: int = 0  # tokens looked up (request.num_tokens per call)
    hits: int = 0  # tokens found computed

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


RECENT_PROMPTS = 256  # finished requests whose tokens `recent_prompts` keeps


class RecentPrompt(NamedTuple):
    """A finished (or recompute-preempted) request's tokens, salt and full-block hashes, for
    explaining misses against the nearest prefix computed before. The lists are the request's
    own (not copied): a preempted request that resumes may still append to them. A tuple:
    `free` builds one per request, so it must be cheap."""

    request_id: str
    token_ids: list[int]
    cache_salt: str | None
    block_hashes: list[BlockHash]


class RequestBlocks:
    """One request's block state in one manager (one KV cache group)."""

    __slots__ = ("blocks", "block_hashes", "num_cached_blocks", "host_blocks", "partial_src")

    def __init__(self) -> None:
        self.blocks: BlockList = BlockList()  # counts its rewrites (block_table.py)
        self.block_hashes: list[BlockHash] = []
        # Leading blocks already offered to the prefix cache (cache_full_blocks done for them).
        self.num_cached_blocks = 0
        self.host_blocks: list[KVCacheBlock] | None = None  # set while swapped out
        # Sub-block hit: the cached block copied into this request's table, held until the
        # runner has copied it (released at the request's next allocate_slots / free / swap).
        self.partial_src: KVCacheBlock | None = None
