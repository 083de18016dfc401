"""HostTier: KV blocks in host RAM (vLLM's `kv_offloading_size` GiB), LRU by an ordered dict."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from pagedkv.events.wire import MEDIUM_HOST
from pagedkv.store.sizing import host_tier_blocks
from pagedkv.store.tier import KVTier


class HostTier(KVTier):
    """Payloads in a dict ordered oldest use first, at most `capacity_bytes` of them."""

    name = "host"
    medium = MEDIUM_HOST

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__()
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"host tier capacity must be a positive byte count, "
                             f"got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._blocks for key in keys]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            for key in keys:
                payload = self._blocks.get(key)
                if payload is not None:
                    self._blocks.move_to_end(key)
                out.append(payload)
        return out

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> list[bytes]:
        new: list[bytes] = []
        evicted: list[bytes] = []
        with self._lock:
            for key, payload in items:
                if key in self._blocks:
                    self._blocks.move_to_end(key)
                    continue
                if len(payload) > self.capacity_bytes:
                    continue
                while self._used + len(payload) > self.capacity_bytes:
                    old_key, old = self._blocks.popitem(last=False)
                    self._used -= len(old)
                    evicted.append(old_key)
                self._blocks[key] = payload
                self._used += len(payload)
                new.append(key)
        if evicted:
            self._note_removed(evicted)
        return new

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def capacity_blocks(self, block_bytes: int) -> int | None:
        return host_tier_blocks(self.capacity_bytes, block_bytes)
