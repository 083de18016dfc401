"""`EvictionPolicy.eviction_order()` is the order the policy really evicts in (the dashboard's
eviction ranks come from it): after random manager traffic, a copy of the policy popped one
block at a time, and another popped all at once, hand out exactly that order (issue 23). The
traffic is the state-replay test's: admit with hits, decode, free, pin, swap, reset."""

from __future__ import annotations

import copy
import random

import pytest

from pagedkv.kv.eviction import EVICTION_POLICIES
from pagedkv.kv.manager import KVCacheManager
from pagedkv.kv.observer import eviction_order
from tests.dashboard.test_state_replay import _random_ops

BS = 4


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_eviction_order_is_the_real_pop_order(policy):
    rng = random.Random(5)
    kv = KVCacheManager(num_blocks=40, block_size=BS, num_host_blocks=8, watermark=0.0,
                        eviction_policy=policy, max_pinned_fraction=0.3)
    live: dict = {}
    checked = 0
    for k in range(40):
        _random_ops(kv, rng, 25, live, [1000 * k])
        kv.check_invariants()
        pool = kv.pool
        order = [b.block_id for b in pool.eviction.eviction_order()]
        assert sorted(order) == sorted(b.block_id for b in pool.eviction.free_blocks())
        one_by_one = copy.deepcopy(pool.eviction)
        popped = [one_by_one.pop(1)[0].block_id for _ in range(one_by_one.num_free_blocks)]
        at_once = copy.deepcopy(pool.eviction)
        assert popped == order
        assert [b.block_id for b in at_once.pop(at_once.num_free_blocks)] == order
        cached = eviction_order(pool)  # what the dashboard ranks: the evictable cached blocks
        assert cached == [i for i in order if pool.blocks[i].block_hash is not None]
        checked += len(cached)
    assert checked > 200  # cached free blocks were really ranked
