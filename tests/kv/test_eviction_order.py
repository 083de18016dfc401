"""`EvictionPolicy.eviction_order()` is the order the policy really evicts in (the dashboard's
eviction ranks come from it): after random manager traffic, a copy of the policy popped one
block at a time, and another popped all at once, hand out exactly that order (issue 23)."""

from __future__ import annotations

import copy
import random

import pytest

from pagedkv.kv.eviction import EVICTION_POLICIES
from pagedkv.kv.manager import KVCacheManager
from pagedkv.kv.observer import eviction_order
from tests.kv.conftest import FakeRequest

BS = 4


def _traffic(kv: KVCacheManager, rng: random.Random, live: dict, n: int) -> None:
    """Admit (with prefix hits), decode and finish requests over a few shared prefixes."""
    prefixes = [[rng.randrange(30) for _ in range(32)] for _ in range(4)]
    for step in range(n):
        if live and rng.random() < 0.45:
            kv.free(live.pop(rng.choice(list(live))))
            continue
        tokens = rng.choice(prefixes)[:rng.randrange(4, 32)] + [rng.randrange(30)]
        req = FakeRequest(f"r{step}-{rng.random()}", tokens)
        hits, num_hit = kv.get_computed_blocks(req)
        if kv.allocate_slots(req, req.num_tokens - num_hit, hits, num_hit) is None:
            kv.free(req)
            continue
        req.num_computed_tokens = req.num_tokens
        live[req.request_id] = req


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_eviction_order_is_the_real_pop_order(policy):
    rng = random.Random(5)
    kv = KVCacheManager(num_blocks=40, block_size=BS, watermark=0.0, eviction_policy=policy)
    live: dict = {}
    checked = 0
    for _ in range(40):
        _traffic(kv, rng, live, 25)
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
