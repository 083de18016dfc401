"""kv/allocation.py: the plan changes nothing, names exactly the free blocks the commit takes,
and a call with nothing to do gets the shared empty plan (no per-step object)."""

from __future__ import annotations

import pytest

from pagedkv.kv.allocation import NOTHING, commit_allocation, plan_allocation
from pagedkv.kv.manager import KVCacheManager
from tests.kv.conftest import make_request, prefill

BS = 4


def _pool_state(m: KVCacheManager) -> tuple:
    return ([b.ref_cnt for b in m.pool.blocks], m.num_free_blocks,
            [b.block_id for b in m.pool.eviction.eviction_order()])


def _forked() -> tuple[KVCacheManager, object]:
    m = KVCacheManager(num_blocks=17, block_size=BS)
    parent = make_request("p", range(10))  # blocks 1 2 full, 3 half full
    prefill(m, parent)
    child = make_request("c", range(10))
    child.num_computed_tokens = 10
    m.fork(parent, child)
    return m, parent


def test_plan_is_pure_and_commit_takes_what_it_counted():
    m, parent = _forked()
    parent.append(50, 51, 52, 53)  # into shared block 3, then a fresh block
    state = m._reqs["p"]
    before = _pool_state(m)
    plan = plan_allocation(state.blocks, BS, parent.num_computed_tokens, 4, None, 0,
                           sub_block_hits=False, num_tokens_ahead=0)
    assert _pool_state(m) == before and m.get_block_ids("p") == [1, 2, 3]
    assert plan.cow == [2] and plan.num_new_blocks == 1 and plan.num_needed == 2
    assert plan.copy_before == 10
    copies: list[tuple[int, int]] = []
    new = commit_allocation(plan, state, m.pool, copies, BS, None)
    assert m.num_free_blocks == before[1] - plan.num_needed
    assert [b.block_id for b in new] == [5] and m.get_block_ids("p") == [1, 2, 4, 5]
    assert copies == [(3, 4)]
    m.check_invariants()


def test_prefix_hits_in_the_free_queue_count_as_needed():
    m = KVCacheManager(num_blocks=17, block_size=BS)
    first = make_request("a", range(9))
    prefill(m, first)
    m.free(first)  # its two full blocks stay cached, free
    second = make_request("b", range(9))
    hits, n = m.get_computed_blocks(second)
    assert n == 8 and all(b.ref_cnt == 0 for b in hits)
    plan = plan_allocation([], BS, 0, 1, hits, n, sub_block_hits=False)
    assert plan.hits == hits and plan.num_new_blocks == 1 and plan.num_needed == 3
    assert m.num_blocks_to_allocate(second, 1, hits, n) == 3


def test_nothing_to_do_is_the_shared_empty_plan():
    m = KVCacheManager(num_blocks=17, block_size=BS)
    req = make_request("a", range(6))
    prefill(m, req)
    req.append(7)  # lands in its own last block
    plan = plan_allocation(m.get_blocks("a"), BS, req.num_computed_tokens, 1, None, 0,
                           sub_block_hits=False)
    assert plan is NOTHING


def test_misplaced_hits_are_refused_by_name():
    m = KVCacheManager(num_blocks=17, block_size=BS)
    req = make_request("a", range(9))
    prefill(m, req)
    with pytest.raises(ValueError, match="num_new_computed_tokens=4"):
        plan_allocation([], BS, 0, 1, m.get_blocks("a")[:2], 4, sub_block_hits=False)
