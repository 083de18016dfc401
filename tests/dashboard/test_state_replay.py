"""The dashboard's page-state model equals the KV manager's own snapshot: 100,000 random pool
operations (allocate, free, cache, evict, pin, swap, reset) through the op stream (issue 23)."""

from __future__ import annotations

import random

import pytest

from pagedkv.engine.block_feed import BlockFeed
from pagedkv.kv.manager import KVCacheManager
from pagedkv.kv.observer import pool_snapshot
from pagedkv.server.dashboard.state import PageState
from tests.kv.conftest import FakeRequest

BS = 4


class _FakeEngine:
    """What BlockFeed reads: the scheduler's manager, queues and stats."""

    class _Sched:
        running: list = []
        waiting: list = []
        loading: list = []
        swapped: list = []

    def __init__(self, kv: KVCacheManager) -> None:
        self.scheduler = self._Sched()
        self.scheduler.kv_cache_manager = kv

    def get_stats(self):
        from pagedkv.engine.stats import EngineStats
        return EngineStats()


def _compare(state: PageState, kv: KVCacheManager) -> None:
    """The page's state equals the pools' own snapshot, eviction ranks included (the snapshot's
    order is the policy's real pop order: tests/kv/test_eviction_order.py)."""
    want = pool_snapshot(kv.pool, kv.pins.pin_counts())
    got = state.pools[0].snapshot()
    assert got["refs"] == want["refs"]
    assert got["hashes"] == want["hashes"]
    assert got["pins"] == want["pins"]
    assert got["free_order"] == want["free_order"]
    assert state.eviction_rank(0) == {b: r for r, b in enumerate(want["free_order"])}
    if kv.host_pool is not None:
        host = state.pools[1].snapshot()
        want_host = pool_snapshot(kv.host_pool)
        assert host["refs"] == want_host["refs"]
        assert host["free_order"] == want_host["free_order"]
    # The forest holds exactly the cached hashes, each at its block.
    assert {h: n.block_id for h, n in state.forest.items()} == {
        h: i for i, h in enumerate(want["hashes"]) if h is not None}
    kv.check_invariants()


def _random_ops(kv: KVCacheManager, rng: random.Random, n: int, live: dict, counter: list) -> int:
    """Apply `n` random manager operations; returns how many changed something."""
    prefixes = [[rng.randrange(50) for _ in range(40)] for _ in range(6)]
    done = 0
    for _ in range(n):
        op = rng.random()
        resident = [r for r in live.values() if not kv.is_swapped(r.request_id)]
        swapped = [r for r in live.values() if kv.is_swapped(r.request_id)]
        if op < 0.30 or not live:  # admit: prefix hits (touch), allocate (evict), cache
            counter[0] += 1
            base = rng.choice(prefixes)[:rng.randrange(1, 40)]
            req = FakeRequest(f"r{counter[0]}", base + [rng.randrange(50)
                                                         for _ in range(rng.randrange(0, 6))],
                              cache_salt=rng.choice([None, None, "s"]))
            hits, num_hit = kv.get_computed_blocks(req)
            if kv.allocate_slots(req, req.num_tokens - num_hit, hits, num_hit) is None:
                kv.free(req)
                continue
            req.num_computed_tokens = req.num_tokens
            live[req.request_id] = req
        elif op < 0.55 and resident:  # decode one token
            req = rng.choice(resident)
            req.append(rng.randrange(50))
            if kv.allocate_slots(req, 1) is None:
                req.all_token_ids.pop()
                continue
            req.num_computed_tokens = req.num_tokens
        elif op < 0.78:  # free (finish)
            req = live.pop(rng.choice(list(live)))
            kv.free(req)
        elif op < 0.86 and resident:  # pin / unpin a prompt prefix
            req = rng.choice(resident)
            try:
                if rng.random() < 0.6:
                    kv.pin_prefix(req.all_token_ids[:rng.randrange(BS, BS * 6)], req.cache_salt)
                else:
                    kv.unpin_prefix(req.all_token_ids[:rng.randrange(BS, BS * 6)], req.cache_salt)
            except ValueError:
                continue
        elif op < 0.93 and resident:  # swap out
            req = rng.choice(resident)
            if not kv.can_swap_out(req):
                continue
            kv.swap_out(req)
        elif op < 0.995 and swapped:  # swap in
            req = rng.choice(swapped)
            if not kv.can_swap_in(req):
                continue
            kv.swap_in(req)
        else:  # reset the prefix cache (only when nothing but pins holds blocks)
            if not kv.reset_prefix_cache():
                continue
        done += 1
    return done


@pytest.mark.parametrize("policy", ["lru", "lfu", "arc"])
def test_page_state_equals_manager_snapshot_over_random_ops(policy):
    rng = random.Random(23)
    kv = KVCacheManager(num_blocks=48, block_size=BS, num_host_blocks=16, watermark=0.0,
                        eviction_policy=policy, max_pinned_fraction=0.3)
    engine = _FakeEngine(kv)
    feed = BlockFeed()
    live: dict = {}
    counter = [0]
    _random_ops(kv, rng, 200, live, counter)  # a busy pool before anyone watches
    sub, snap = feed.subscribe(engine)
    state = PageState(snap["pools"])
    _compare(state, kv)
    total = 0
    num_ops = 100_000 if policy == "lru" else 20_000
    evictions_before = kv.eviction_log.num_evictions
    for _ in range(num_ops // 1000):
        total += _random_ops(kv, rng, 1000, live, counter)
        update = feed.drain(engine, sub)
        state.apply(update["ops"], update["t"])
        _compare(state, kv)
        assert ("o" in {op[0] for op in update["ops"]}) == (policy != "lru")
    assert total > num_ops // 2  # most operations really changed the pool
    assert kv.eviction_log.num_evictions - evictions_before > 1000  # evictions were exercised
    feed.unsubscribe(engine, sub)
    assert kv.pool.observer is None and kv.host_pool.observer is None and feed.ops == []


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_nothing_is_recorded_without_a_subscriber_and_two_subscribers_see_the_same(policy):
    kv = KVCacheManager(num_blocks=32, block_size=BS, num_host_blocks=8, watermark=0.0,
                        eviction_policy=policy)
    engine = _FakeEngine(kv)
    feed = BlockFeed()
    rng = random.Random(1)
    live: dict = {}
    _random_ops(kv, rng, 300, live, [0])
    assert kv.pool.observer is None and feed.ops == []
    a, snap_a = feed.subscribe(engine)
    state_a = PageState(snap_a["pools"])
    _random_ops(kv, rng, 300, live, [1000])
    b, snap_b = feed.subscribe(engine)
    state_b = PageState(snap_b["pools"])
    for _ in range(3):
        _random_ops(kv, rng, 300, live, [2000 + _ * 1000])
        for sub, state in ((a, state_a), (b, state_b)):
            update = feed.drain(engine, sub)
            state.apply(update["ops"], update["t"])
            _compare(state, kv)
    feed.unsubscribe(engine, a)
    assert kv.pool.observer is not None  # b still watches
    feed.unsubscribe(engine, b)
    assert kv.pool.observer is None


def test_a_subscriber_past_the_backlog_gets_a_resync_snapshot():
    kv = KVCacheManager(num_blocks=32, block_size=BS, watermark=0.0)
    engine = _FakeEngine(kv)
    feed = BlockFeed(max_backlog=50)
    sub, snap = feed.subscribe(engine)
    _random_ops(kv, random.Random(2), 500, {}, [0])
    update = feed.drain(engine, sub)
    assert "resync" in update and "ops" not in update
    state = PageState(update["resync"]["pools"])
    _compare(state, kv)
    assert feed.ops == []  # trimmed to the cursor
