"""A bounded ring of eviction records: when a cached block's hash was evicted, by which policy,
to make room for which request. Read by `POST /v1/cache/explain` (issue 23).

The pool appends one record per evicted hash (only evictions, never hits or frees), and a dict
indexes the newest record of each hash still in the ring; both are bounded by `capacity`, so
the memory is O(capacity) whatever the uptime. Written and read in the engine loop thread.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from pagedkv.kv.hashing import BlockHash

DEFAULT_EVICTION_LOG_CAPACITY = 65536


@dataclass(frozen=True, slots=True)
class EvictionRecord:
    """One evicted hash. `time` is wall-clock seconds (time.time()); `for_request` is the id
    of the request whose allocation reused the block (None when unknown), `for_salt` its
    cache_salt (explain names the request only to a caller with the same salt)."""

    block_hash: BlockHash
    block_id: int
    time: float
    policy: str
    for_request: str | None
    for_salt: str | None = None


class EvictionLog:
    """The newest `capacity` eviction records, looked up by hash in O(1). The ring holds plain
    tuples (hash, block id, time, request id, its salt): `record` is on the eviction path, so it
    builds no object; `lookup` builds the `EvictionRecord`."""

    def __init__(self, policy: str, capacity: int = DEFAULT_EVICTION_LOG_CAPACITY) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"eviction log capacity must be a positive int, got {capacity!r}")
        self.policy = policy
        self.capacity = capacity
        self._ring: deque[tuple[BlockHash, int, float, str | None, str | None]] = deque()
        self._by_hash: dict[BlockHash, tuple[BlockHash, int, float, str | None, str | None]] = {}
        self.num_evictions = 0  # every eviction since start (the ring keeps the newest)
        # Set by the KV manager before it allocates: whom the evictions of that call serve.
        self.allocating_for: str | None = None
        self.allocating_salt: str | None = None  # that request's cache_salt

    def record(self, block_hash: BlockHash, block_id: int) -> None:
        """Append a record (dropping the oldest when full)."""
        ring = self._ring
        if len(ring) == self.capacity:
            old = ring.popleft()
            if self._by_hash.get(old[0]) is old:
                del self._by_hash[old[0]]
        rec = (block_hash, block_id, _now(), self.allocating_for, self.allocating_salt)
        ring.append(rec)
        self._by_hash[block_hash] = rec
        self.num_evictions += 1

    def lookup(self, block_hash: BlockHash) -> EvictionRecord | None:
        """The newest record of `block_hash` still in the ring, or None."""
        rec = self._by_hash.get(block_hash)
        return None if rec is None else EvictionRecord(rec[0], rec[1], rec[2], self.policy,
                                                       rec[3], rec[4])

    def __len__(self) -> int:
        return len(self._ring)


_now = time.time
