"""The dashboard's feed on the engine core's side: who watches, and what each watcher has not
seen.

`BlockFeed` belongs to one engine core (`EngineCore.dashboard`, never a global). Every method
runs in the thread that steps the core, between steps (the routes reach it through utility
calls: pagedkv/engine/dashboard_calls.py), so the pools, the scheduler and the op list are read
and written by one thread only, in the core process or in-process alike.

Nothing is recorded while no one watches: the pools' `observer` stays None until the first
`subscribe` and is reset to None by the last `unsubscribe`. While watched, the pools append ops
to one shared list; each subscriber has a cursor into it and `drain` hands it the ops after its
cursor (the list is trimmed to the slowest cursor). A subscriber that falls more than
`max_backlog` ops behind is told to resync (it gets a fresh snapshot) instead of growing memory.

Eviction order: the page rebuilds LRU's order from the ref ops alone (a block joins the tail when
freed). LFU and ARC order by counts and lists the ops do not show, so for them `drain` appends an
["o", pool, [block_id, ...]] op (the policy's exact `eviction_order()`) whenever that pool
changed since the last one: the page's ranks are the policy's, at every update.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from pagedkv.kv.observer import BlockOpRecorder, order_op, pool_snapshot, short_hash

MAX_BACKLOG_OPS = 1_000_000
MAX_LISTED_REQUESTS = 512  # per queue, in each update
MAX_LISTED_FINISHED = 30  # latest finished requests, in each update


class BlockFeed:
    """Subscribers of one engine's block feed. Engine loop thread only."""

    def __init__(self, max_backlog: int = MAX_BACKLOG_OPS) -> None:
        self.max_backlog = max_backlog
        self.ops: list[list[Any]] = []
        self._base = 0  # absolute index of ops[0]
        self._cursors: dict[int, int] = {}
        self._ids = itertools.count(1)
        self._order_mark = 0  # absolute index after the last "o" ops appended

    @property
    def num_subscribers(self) -> int:
        return len(self._cursors)

    def subscribe(self, engine: Any) -> tuple[int, dict[str, Any]]:
        """Start watching (attaching the recorders when first); returns the subscriber id and
        the snapshot its ops start from. Mutates the pools' observers and the cursors."""
        kv = engine.scheduler.kv_cache_manager
        if not self._cursors:
            self.ops.clear()
            self._base = self._order_mark = 0
            kv.pool.observer = BlockOpRecorder(self.ops, 0)
            if kv.host_pool is not None:
                kv.host_pool.observer = BlockOpRecorder(self.ops, 1)
        sub = next(self._ids)
        self._cursors[sub] = self._base + len(self.ops)
        return sub, subscriber_snapshot(self, engine)

    def unsubscribe(self, engine: Any, sub: int) -> None:
        """Stop watching; the last one out detaches the recorders (no cost from then on).
        Unknown ids are ignored."""
        self._cursors.pop(sub, None)
        if not self._cursors:
            kv = engine.scheduler.kv_cache_manager
            kv.pool.observer = None
            if kv.host_pool is not None:
                kv.host_pool.observer = None
            self.ops.clear()
        else:
            self._trim()

    def drain(self, engine: Any, sub: int) -> dict[str, Any]:
        """The ops `sub` has not seen (or a fresh snapshot under "resync"), plus the engine's
        stats and queues now. Appends eviction-order ops (see the module docstring), advances
        `sub`'s cursor and trims the op list. ValueError for an unknown `sub`."""
        cursor = self._cursors.get(sub)
        if cursor is None:
            raise ValueError(f"unknown dashboard subscriber {sub!r}")
        self._append_orders(engine.scheduler.kv_cache_manager)
        end = self._base + len(self.ops)
        update: dict[str, Any] = {"t": time.time()}
        if end - cursor > self.max_backlog:
            update["resync"] = snapshot(engine)
        else:
            update["ops"] = self.ops[cursor - self._base:]
        self._cursors[sub] = end
        self._trim()
        update.update(engine_state(engine))
        return update

    def _append_orders(self, kv: Any) -> None:
        """Append an "o" op for each pool whose policy's order the ref ops do not give and
        that changed since the last "o" ops."""
        pools = [kv.pool] if kv.host_pool is None else [kv.pool, kv.host_pool]
        new = self.ops[max(self._order_mark - self._base, 0):]
        touched = {op[1] for op in new}
        for index, pool in enumerate(pools):
            if index in touched and not pool.eviction.order_follows_frees:
                self.ops.append(order_op(pool, index))
        self._order_mark = self._base + len(self.ops)

    def _trim(self) -> None:
        low = min(self._cursors.values())
        if low > self._base:
            del self.ops[:low - self._base]
            self._base = low


def snapshot(engine: Any) -> dict[str, Any]:
    """Both pools' block state, the parents of cached hashes (from the hashes of live and recent
    requests) and the block size. O(blocks + live tokens)."""
    kv = engine.scheduler.kv_cache_manager
    pools = [pool_snapshot(kv.pool, kv.pins.pin_counts())]
    if kv.host_pool is not None:
        pools.append(pool_snapshot(kv.host_pool))
    cached = kv.pool.cached_block_hash_to_block
    parents: dict[str, str | None] = {}
    chains = kv.live_block_hashes()
    chains += [p.block_hashes for p in kv.recent_prompts]
    for chain in chains:
        for i, block_hash in enumerate(chain):
            if block_hash in cached:
                parents[short_hash(block_hash)] = short_hash(chain[i - 1]) if i else None
    return {"t": time.time(), "block_size": kv.block_size, "pools": pools, "parents": parents,
            "eviction_policy": kv.eviction_log.policy}


def subscriber_snapshot(feed: BlockFeed, engine: Any) -> dict[str, Any]:
    """`snapshot` plus how many subscribers the feed has now (this one included)."""
    return {**snapshot(engine), "subscribers": feed.num_subscribers}


def engine_state(engine: Any) -> dict[str, Any]:
    """Stats (cumulative counters and gauges), the request queues and the ids of the latest
    finished requests (oldest first; the ones /dashboard/api/explain/{id} explains), for one
    update."""
    sched = engine.scheduler
    kv = sched.kv_cache_manager
    stats = engine.get_stats().to_dict()
    stats["num_evictions"] = kv.eviction_log.num_evictions
    stats["time"] = time.time()
    queues = {}
    for name, queue in (("running", sched.running), ("waiting", sched.waiting + sched.loading),
                        ("swapped", sched.swapped)):
        queues[name] = [[r.request_id, r.num_tokens, r.num_computed_tokens,
                         max(r.num_cached_tokens, 0)] for r in queue[:MAX_LISTED_REQUESTS]]
    recent = kv.recent_prompts
    finished = [recent[i].request_id for i in range(max(len(recent) - MAX_LISTED_FINISHED, 0),
                                                    len(recent))]
    return {"stats": stats, "queues": queues, "finished": finished}


def block_table(engine: Any, request_id: str) -> dict[str, Any] | None:
    """A live request's block table: logical index -> physical block (device, or host while
    swapped), its ref count (shared when > 1), hash and pin count. None for an unknown id."""
    kv = engine.scheduler.kv_cache_manager
    found = kv.block_table(request_id)
    if found is None:
        return None
    blocks, swapped = found
    pins = kv.pins.pin_counts()
    rows = [{"logical": i, "physical": b.block_id, "ref_cnt": b.ref_cnt,
             "hash": short_hash(b.block_hash), "shared": b.ref_cnt > 1,
             "pinned": pins.get(b.block_id, 0) if not swapped else 0, "null": b.is_null}
            for i, b in enumerate(blocks)]
    return {"request_id": request_id, "tier": "host" if swapped else "device",
            "block_size": kv.block_size, "blocks": rows}
