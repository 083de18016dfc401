"""KVTier: the interface every store tier implements (a new tier is a new file).

Keys are `model identity + chained block hash` bytes (see identity.py); values are one block's
payload (raw KV bytes, `bytes` or a uint8 tensor row: see payload.py). A tier is bounded and evicts least recently used blocks first; `get_many`
counts as a use (promotes). Every method may be called from the engine thread and the store's
saver thread at once: tiers lock their own state. A tier that fails (I/O error, server down)
answers misses and drops writes; it never raises into the engine.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence

from pagedkv.store.payload import Payload


class KVTier(ABC):
    """One storage level. Subclasses set `name` (for metrics) and `medium` (for KV events)."""

    name: str = "tier"
    medium: str = "CPU"
    record_removals: bool = False  # set by the store when KV events are on

    def __init__(self) -> None:
        self._removed_lock = threading.Lock()
        self._removed: list[bytes] = []

    @abstractmethod
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored (no promotion)."""

    @abstractmethod
    def get_many(self, keys: Sequence[bytes]) -> list[Payload | None]:
        """Each key's verified payload, or None for a miss; hits become most recently used."""

    @abstractmethod
    def put_many(self, items: Sequence[tuple[bytes, Payload]]) -> list[bytes]:
        """Store (key, payload) pairs, evicting LRU blocks to stay within capacity.

        Returns the keys that are newly stored (a key already present is only refreshed).
        """

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes held now, headers included where stored (0 when the tier cannot tell)."""

    @property
    @abstractmethod
    def num_blocks(self) -> int:
        """Blocks held now (0 when the tier cannot tell)."""

    def capacity_blocks(self, block_bytes: int) -> int | None:
        """How many blocks of `block_bytes` fit (None: bounded outside us, e.g. by Redis)."""
        return None

    def close(self) -> None:  # noqa: B027 (most tiers hold nothing to release)
        """Release files, connections and threads. Idempotent."""

    # ---- eviction notices (for KV events) ----------------------------------------------
    def _note_removed(self, keys: Sequence[bytes]) -> None:
        if not self.record_removals:
            return
        with self._removed_lock:
            self._removed.extend(keys)

    def take_removed(self) -> list[bytes]:
        """Drain the keys evicted since the last call."""
        with self._removed_lock:
            removed, self._removed = self._removed, []
        return removed
