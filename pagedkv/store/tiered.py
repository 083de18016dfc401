"""TieredKVStore: the tiers in order (host RAM, disk, Redis), one lookup/load/save interface.

- `lookup(hashes)`: how many leading blocks some tier holds (the first miss stops, as in the
  seed's `get` loop: a chained hash is only useful after its parent).
- `load(metas)`: the payloads of the leading blocks, each from the fastest tier that has it and
  verifies; blocks found below the top tier are promoted into the faster ones (queued to the
  saver). The result may be shorter than `lookup` said (a block evicted or corrupt meanwhile):
  the caller recomputes the rest. `load_async(metas, finish)` runs `finish(load(metas))` on the
  store's loader threads and returns its Future (the engine never waits on a tier).
- `save_async(metas, make_payloads)`: queued to a background thread, which builds the payloads
  (off the engine's hot path) and writes them through to every tier.

Tiers' stores and evictions become KV events (`take_events`) with each tier's `medium`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from pagedkv.events import wire
from pagedkv.kv.hashing import group_key_suffix, split_group_key
from pagedkv.store.identity import block_key
from pagedkv.store.payload import Payload, payload_nbytes
from pagedkv.store.stats import TierStats
from pagedkv.store.tier import KVTier

logger = logging.getLogger(__name__)

_STOP = object()
T = TypeVar("T")


@dataclass(frozen=True)
class BlockMeta:
    """One block's chained hash, its parent's (None for a first block), its tokens and its
    extra keys in vLLM's event form (`pagedkv.kv.hashing.event_extra_keys`); with KV cache
    groups (a model mixing attention types) the group whose block it is, part of its key
    (`group_key_suffix`: group 0's key is the plain hash's) and of its events."""

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    group_idx: int | None = None
    extra_keys: tuple | None = None


class TieredKVStore:
    """Owns the tiers, the saver thread and the loader threads. Thread-safe: the engine thread
    looks up, loader threads load and the saver thread writes, at once."""

    def __init__(self, tiers: Sequence[KVTier], identity: bytes, block_bytes: int,
                 block_size: int, enable_events: bool = False, max_pending_saves: int = 256,
                 num_load_threads: int = 4, grouped: bool = False) -> None:
        """`grouped`: the blocks are KV cache groups' (BlockMeta.group_idx set); events then
        name every block's group, group 0 included."""
        if not tiers:
            raise ValueError("a TieredKVStore needs at least one tier")
        self.tiers = list(tiers)
        self.identity = identity
        self.block_bytes = block_bytes
        self.block_size = block_size
        self.enable_events = enable_events
        self.grouped = grouped
        self.stats = {t.name: TierStats(t.name, t.medium) for t in self.tiers}
        for tier in self.tiers:
            tier.record_removals = enable_events
        self.num_dropped_saves = 0
        self._saves_lock = threading.Lock()
        self._saves_queued = 0  # saves queued so far (a save ticket), and written (in order)
        self._saves_done = 0
        self._events: list[wire.KVCacheEvent] = []
        self._events_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending_saves)
        self._saver = threading.Thread(target=self._save_loop, name="kv-store-saver", daemon=True)
        self._saver.start()
        self._loader = ThreadPoolExecutor(num_load_threads, thread_name_prefix="kv-store-load")

    def key(self, block_hash: bytes, group_idx: int | None = None) -> bytes:
        """The store key of a block hash (of KV cache group `group_idx`'s block)."""
        return block_key(self.identity, block_hash + group_key_suffix(group_idx or 0))

    # ---- lookup and load (engine thread) -------------------------------------------------
    def lookup(self, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of `block_hashes` held by some tier."""
        present = self.holds([(h, None) for h in block_hashes])
        n = 0
        while n < len(present) and present[n]:
            n += 1
        return n

    def holds(self, blocks: Sequence[tuple[bytes, int | None]]) -> list[bool]:
        """Whether some tier holds each (block hash, KV cache group) block (one query per
        tier for all of them)."""
        keys = [self.key(h, g) for h, g in blocks]
        present = [False] * len(keys)
        for tier in self.tiers:
            missing = [i for i, p in enumerate(present) if not p]
            if not missing:
                break
            for i, found in zip(missing, tier.contains_many([keys[i] for i in missing]),
                                strict=True):
                present[i] = found
        return present

    def load_async(self, metas: Sequence[BlockMeta],
                   finish: Callable[[list[Payload]], T]) -> Future[T]:
        """`finish(self.load(metas))` on a loader thread; its Future (an exception inside is
        the Future's). Raises RuntimeError after `close`."""
        return self._loader.submit(lambda: finish(self.load(metas)))

    def load(self, metas: Sequence[BlockMeta]) -> list[Payload]:
        """Payloads of the leading blocks found and verified (see module docstring)."""
        keys = [self.key(m.block_hash, m.group_idx) for m in metas]
        payloads: list[Payload | None] = [None] * len(keys)
        found_in: list[int] = [-1] * len(keys)
        limit = len(keys)
        for level, tier in enumerate(self.tiers):
            missing = [i for i in range(limit) if payloads[i] is None]
            if not missing:
                break
            start = time.perf_counter()
            got = tier.get_many([keys[i] for i in missing])
            elapsed = time.perf_counter() - start
            hits = 0
            nbytes = 0
            for i, payload in zip(missing, got, strict=True):
                if payload is not None and payload_nbytes(payload) == self.block_bytes:
                    payloads[i] = payload
                    found_in[i] = level
                    hits += 1
                    nbytes += self.block_bytes
            stats = self.stats[tier.name]
            with stats.lock:
                stats.hits += hits
                stats.misses += len(missing) - hits
                stats.bytes_read += nbytes
                stats.load_seconds.observe(elapsed)
        n = 0
        while n < limit and payloads[n] is not None:
            n += 1
        loaded = [p for p in payloads[:n] if p is not None]
        for level in sorted({found_in[i] for i in range(n)} - {0}):
            promote = [i for i in range(n) if found_in[i] == level]
            self._enqueue([metas[i] for i in promote],
                          lambda promote=promote: [loaded[i] for i in promote],
                          self.tiers[:level])
        return loaded

    # ---- saves (saver thread) -------------------------------------------------------------
    def save_async(self, metas: Sequence[BlockMeta],
                   make_payloads: Callable[[], Sequence[Payload]]) -> None:
        """Queue blocks to write through to every tier; `make_payloads` runs on the saver thread
        and must return one payload per meta. A full queue drops the save (counted)."""
        if metas:
            self._enqueue(list(metas), make_payloads, self.tiers)

    def _enqueue(self, metas: list[BlockMeta], make_payloads: Callable[[], Sequence[Payload]],
                 tiers: list[KVTier]) -> None:
        with self._saves_lock:
            try:
                self._queue.put_nowait((metas, make_payloads, tiers))
                self._saves_queued += 1
            except queue.Full:
                self.num_dropped_saves += 1

    def _save_loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is _STOP:
                    return
                self._save(*job)
            except Exception:  # a failing save costs future hits only
                logger.exception("kv store: a save failed")
            finally:
                self._queue.task_done()
                with self._saves_lock:
                    self._saves_done += 1

    def _save(self, metas: list[BlockMeta], make_payloads: Callable[[], Sequence[Payload]],
              tiers: list[KVTier]) -> None:
        payloads = make_payloads()
        items = [(self.key(m.block_hash, m.group_idx), p)
                 for m, p in zip(metas, payloads, strict=True)]
        by_key = {key: meta for key, meta in zip((k for k, _ in items), metas, strict=True)}
        for tier in tiers:
            start = time.perf_counter()
            new = tier.put_many(items)
            elapsed = time.perf_counter() - start
            stats = self.stats[tier.name]
            with stats.lock:
                stats.blocks_written += len(new)
                stats.bytes_written += len(new) * self.block_bytes
                stats.save_seconds.observe(elapsed)
            if self.enable_events and new:
                self._add_events([self._stored_event(by_key[k], tier.medium) for k in new])

    def _stored_event(self, meta: BlockMeta, medium: str) -> wire.BlockStored:
        return wire.block_stored([meta.block_hash], meta.parent_hash, list(meta.token_ids),
                                 self.block_size, medium=medium, group_idx=meta.group_idx,
                                 extra_keys=[meta.extra_keys])

    def save_ticket(self) -> int:
        """A mark of the saves queued so far: `saved_through(ticket)` once they are written."""
        with self._saves_lock:
            return self._saves_queued

    def saves_written(self) -> int:
        """The saved-through watermark: how many queued saves are written (or failed); the one
        saver thread writes them in order, so every save of a ticket at most this is done."""
        with self._saves_lock:
            return self._saves_done

    def saved_through(self, ticket: int) -> bool:
        """Whether every save queued before `save_ticket()` returned `ticket` is written (or
        failed)."""
        return self.saves_written() >= ticket

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued save is written (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    # ---- events and stats -----------------------------------------------------------------
    def _add_events(self, events: list[wire.KVCacheEvent]) -> None:
        with self._events_lock:
            self._events.extend(events)

    def take_events(self) -> list[wire.KVCacheEvent]:
        """Tier stores and evictions since the last call, as wire events."""
        if not self.enable_events:
            return []
        n = len(self.identity)
        for tier in self.tiers:
            removed = [split_group_key(k[n:]) for k in tier.take_removed()
                       if k[:n] == self.identity]
            for group_idx in sorted({g for _, g in removed}):  # one event per KV cache group
                self._add_events([wire.BlockRemoved(
                    block_hashes=[h for h, g in removed if g == group_idx], medium=tier.medium,
                    group_idx=group_idx if self.grouped else None)])
        with self._events_lock:
            events, self._events = self._events, []
        return events

    def snapshot_stats(self) -> list[TierStats]:
        """The per-tier stats with usage refreshed (the live objects; read, don't mutate)."""
        for tier in self.tiers:
            stats = self.stats[tier.name]
            stats.used_bytes = tier.used_bytes
            stats.num_blocks = tier.num_blocks
        return [self.stats[t.name] for t in self.tiers]

    def close(self) -> None:
        """Finish queued saves, stop the saver and the loaders (loads not yet started are
        cancelled), close the tiers. Idempotent."""
        self._loader.shutdown(wait=False, cancel_futures=True)
        if self._saver.is_alive():
            self._queue.put(_STOP)
            self._saver.join(timeout=30)
        for tier in self.tiers:
            tier.close()
