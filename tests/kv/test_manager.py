"""KVCacheManager: prefix hits, admission, allocation, copy-on-write, sliding window, swap."""

import pytest

from pagedkv.kv.events import BlockRemoved, BlockStored
from pagedkv.kv.manager import AllocStatus, KVCacheManager
from tests.kv.conftest import decode, make_request, prefill

BS = 4


def mgr_(num_blocks=17, **kw):
    kw.setdefault("watermark", 0.0)
    return KVCacheManager(num_blocks=num_blocks, block_size=BS, **kw)


def test_prefill_and_decode_allocate_exact_blocks():
    m = mgr_()
    r = make_request("r", range(10))
    new, hit = prefill(m, r)
    assert hit == 0 and [b.block_id for b in new] == [1, 2, 3]
    assert m.get_block_ids("r") == [1, 2, 3] and m.num_free_blocks == 13
    assert decode(m, r, 10) == [] and decode(m, r, 11) == []  # 12 tokens: block 3 full
    assert [b.block_id for b in decode(m, r, 12)] == [4]
    assert m.get_block_ids("r") == [1, 2, 3, 4]
    assert m.usage == pytest.approx(4 / 16)
    m.check_invariants()
    m.free(r)
    assert m.num_free_blocks == 16 and m.usage == 0.0
    m.free(r)  # unknown request: no-op
    m.check_invariants()


def test_prefix_hit_shares_blocks_and_counts_tokens():
    m = mgr_()
    a = make_request("a", range(10))
    prefill(m, a)
    b = make_request("b", list(range(8)) + [99, 98, 97])
    hits, n = m.get_computed_blocks(b)
    assert [x.block_id for x in hits] == [1, 2] and n == 8
    assert hits[0].ref_cnt == 1  # get_computed_blocks does not touch
    new = m.allocate_slots(b, b.num_tokens - n, hits, n)
    assert [x.block_id for x in new] == [4]
    assert m.get_block_ids("b") == [1, 2, 4] and hits[0].ref_cnt == 2
    s = m.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (2, 10 + 11, 8)
    assert s.hit_rate == pytest.approx(8 / 21)
    m.check_invariants()


def test_full_prompt_hit_recomputes_last_token():
    m = mgr_()
    a = make_request("a", range(12))  # exactly 3 full blocks
    prefill(m, a)
    b = make_request("b", range(12))
    hits, n = m.get_computed_blocks(b)
    assert len(hits) == 2 and n == 8  # the last block would cover the last token: dropped
    c = make_request("c", range(13))
    hits, n = m.get_computed_blocks(c)
    assert len(hits) == 3 and n == 12
    m.check_invariants()


def test_lazy_eviction_hit_after_free_revives_block():
    m = mgr_()
    a = make_request("a", range(9))
    prefill(m, a)
    m.free(a)
    assert m.num_free_blocks == 16
    b = make_request("b", range(9))
    hits, n = m.get_computed_blocks(b)
    assert [x.block_id for x in hits] == [1, 2] and n == 8
    m.allocate_slots(b, 1, hits, n)
    assert m.get_block_ids("b")[:2] == [1, 2] and m.num_free_blocks == 13
    m.check_invariants()


def test_free_is_tail_first_so_prefix_survives():
    m = mgr_(num_blocks=6)  # 5 usable
    a = make_request("a", range(16))  # 4 full blocks, all cached
    prefill(m, a)
    m.free(a)
    assert [b.block_id for b in m.pool.eviction.free_blocks()] == [5, 4, 3, 2, 1]
    b = make_request("b", range(100, 108))  # takes 5, 4
    prefill(m, b)
    c = make_request("c", range(16))
    hits, n = m.get_computed_blocks(c)
    assert [x.block_id for x in hits] == [1, 2, 3] and n == 12
    m.check_invariants()


def test_salt_isolation():
    m = mgr_()
    a = make_request("a", range(9), cache_salt="t1")
    prefill(m, a)
    assert m.get_computed_blocks(make_request("b", range(9), cache_salt="t2"))[1] == 0
    assert m.get_computed_blocks(make_request("c", range(9)))[1] == 0
    assert m.get_computed_blocks(make_request("d", range(9), cache_salt="t1"))[1] == 8
    # The salt is only in block 0's keys, yet every chained hash differs.
    ha = m.get_block_hashes("a")
    hb = m.get_block_hashes("b")
    assert len(ha) == len(hb) == 2 and ha[0] != hb[0] and ha[1] != hb[1]
    for rid in "bcd":
        m.free(make_request(rid, []))
    m.check_invariants()


def test_lora_isolation():
    m = mgr_()
    prefill(m, make_request("a", range(9), lora_name="x"))
    assert m.get_computed_blocks(make_request("b", range(9), lora_name="y"))[1] == 0
    assert m.get_computed_blocks(make_request("c", range(9)))[1] == 0
    assert m.get_computed_blocks(make_request("d", range(9), lora_name="x"))[1] == 8
    assert m.get_computed_blocks(make_request("e", range(9), cache_salt="x"))[1] == 0
    m.check_invariants()


def test_caching_disabled():
    m = mgr_(enable_caching=False)
    prefill(m, make_request("a", range(9)))
    b = make_request("b", range(9))
    assert m.get_computed_blocks(b) == ([], 0)
    assert m.prefix_cache_stats.requests == 0 and m.pool.cached_block_hash_to_block == {}
    m.check_invariants()


def test_can_allocate_boundaries_with_watermark():
    # 21 blocks -> 20 usable, watermark 0.1 -> 2 blocks kept free.
    m = KVCacheManager(num_blocks=21, block_size=BS, watermark=0.1)
    assert m.num_usable_blocks == 20 and m.watermark_blocks == 2
    assert m.can_allocate(make_request("x", range(18 * BS))) is AllocStatus.OK  # 20-18 == 2
    assert m.can_allocate(make_request("x", range(18 * BS + 1))) is AllocStatus.NEVER  # 19
    filler = make_request("f", range(5 * BS))
    prefill(m, filler)  # 15 free
    assert m.can_allocate(make_request("x", range(13 * BS))) is AllocStatus.OK  # 15-13 == 2
    assert m.can_allocate(make_request("x", range(13 * BS + 1))) is AllocStatus.LATER
    assert m.can_allocate(make_request("x", range(14 * BS))) is AllocStatus.LATER
    # Hits held by another request need no memory; cached free blocks do.
    y = make_request("y", list(range(5 * BS)) + list(range(1000, 1000 + 9 * BS)))  # 14 blocks
    hits, n = m.get_computed_blocks(y)
    assert len(hits) == 5 and all(b.ref_cnt == 1 for b in hits)
    assert m.can_allocate(y) is AllocStatus.LATER
    assert m.can_allocate(y, 5) is AllocStatus.OK
    assert m.can_allocate(y, computed_blocks=hits) is AllocStatus.OK
    m.free(filler)  # hits now sit in the free queue (ref 0): 20 free, they cost a block each
    assert m.can_allocate(y, computed_blocks=hits) is AllocStatus.OK
    z = make_request("z", list(range(5 * BS)) + list(range(2000, 2000 + 14 * BS)))  # 19 blocks
    assert m.can_allocate(z, computed_blocks=m.get_computed_blocks(z)[0]) is AllocStatus.NEVER
    m.check_invariants()


def test_allocate_slots_none_changes_nothing():
    m = mgr_(num_blocks=6)  # 5 usable
    a = make_request("a", range(8))
    prefill(m, a)
    m.free(a)  # blocks 1, 2 cached and free
    big = make_request("b", list(range(8)) + list(range(100, 113)))  # 6 blocks needed
    hits, n = m.get_computed_blocks(big)
    assert len(hits) == 2
    free_before = [b.block_id for b in m.pool.eviction.free_blocks()]
    assert m.allocate_slots(big, big.num_tokens - n, hits, n) is None
    assert [b.block_id for b in m.pool.eviction.free_blocks()] == free_before
    assert m.get_block_ids("b") == [] and hits[0].ref_cnt == 0 and hits[1].ref_cnt == 0
    assert m.pool.get_cached_block(hits[0].block_hash) is hits[0]
    m.check_invariants()
    # Hits in the free queue are not counted as free: 5 free, 2 hits + 3 new fits exactly.
    fit = make_request("c", list(range(8)) + list(range(100, 109)))  # 5 blocks
    hits, n = m.get_computed_blocks(fit)
    assert m.allocate_slots(fit, fit.num_tokens - n, hits, n) is not None
    assert m.num_free_blocks == 0
    m.check_invariants()


def test_apply_watermark_keeps_blocks_free():
    m = KVCacheManager(num_blocks=11, block_size=BS, watermark=0.2)  # 10 usable, keep 2
    r = make_request("r", range(9 * BS))
    assert m.allocate_slots(r, r.num_tokens, apply_watermark=True) is None
    assert m.get_block_ids("r") == []
    r2 = make_request("r2", range(8 * BS))
    assert len(m.allocate_slots(r2, r2.num_tokens, apply_watermark=True)) == 8
    m.check_invariants()


def test_delay_cache_blocks_then_cache_blocks():
    m = mgr_()
    r = make_request("r", range(9))
    m.allocate_slots(r, 9, delay_cache_blocks=True)
    assert m.pool.cached_block_hash_to_block == {}
    m.cache_blocks(r, 5)
    assert m.get_blocks("r")[0].block_hash is not None and m.get_blocks("r")[1].block_hash is None
    m.cache_blocks(r, 9)
    assert len(m.pool.cached_block_hash_to_block) == 2
    m.check_invariants()


def test_copy_on_write_after_fork():
    m = mgr_()
    parent = make_request("p", range(10))  # blocks 1 2 full, 3 half full
    prefill(m, parent)
    child = make_request("c", range(10))
    child.num_computed_tokens = 10
    m.fork(parent, child)
    assert m.get_block_ids("c") == [1, 2, 3]
    assert all(b.ref_cnt == 2 for b in m.get_blocks("p"))
    m.check_invariants()
    assert decode(m, parent, 50) == []  # writes into shared partial block 3: copied
    assert m.get_block_ids("p") == [1, 2, 4]
    assert m.take_block_copies() == [(3, 4)] and m.take_block_copies() == []
    assert decode(m, child, 60) == []  # block 3 now only the child's: written in place
    assert m.get_block_ids("c") == [1, 2, 3] and m.take_block_copies() == []
    assert [b.ref_cnt for b in m.get_blocks("c")] == [2, 2, 1]
    m.check_invariants()
    m.free(parent)
    m.free(child)
    assert m.num_free_blocks == 16
    m.check_invariants()


def test_full_shared_blocks_are_never_copied():
    m = mgr_()
    parent = make_request("p", range(8))  # two full blocks
    prefill(m, parent)
    child = make_request("c", range(8))
    child.num_computed_tokens = 8
    m.fork(parent, child)
    new = decode(m, parent, 1)
    assert [b.block_id for b in new] == [3] and m.get_block_ids("p") == [1, 2, 3]
    assert decode(m, child, 2) is not None
    assert m.get_block_ids("c") == [1, 2, 4] and m.take_block_copies() == []
    m.check_invariants()


def test_fork_rejects_unknown_parent_and_existing_child():
    m = mgr_()
    a = make_request("a", range(4))
    with pytest.raises(ValueError, match="'a'"):
        m.fork(a, make_request("b", []))
    prefill(m, a)
    with pytest.raises(ValueError, match="'a'"):
        m.fork(a, a)
    m.check_invariants()


def test_sliding_window_frees_blocks_outside_window():
    m = mgr_(sliding_window=8)
    r = make_request("r", range(12))
    prefill(m, r)
    assert m.get_block_ids("r") == [1, 2, 3]
    # Decode at position 12: window covers positions 5..12, so block 0 (0..3) is freed.
    decode(m, r, 12)
    assert m.get_block_ids("r") == [0, 2, 3, 4]
    assert m.pool.blocks[1].ref_cnt == 0 and m.num_free_blocks == 13
    m.check_invariants()
    for t in range(13, 17):  # position 16: window 9..16, block 1 (4..7) goes too
        decode(m, r, t)
    assert m.get_block_ids("r") == [0, 0, 3, 4, 5]
    assert [b.ref_cnt for b in m.get_blocks("r")] == [0, 0, 1, 1, 1]
    m.check_invariants()
    m.free(r)
    assert m.num_free_blocks == 16
    m.check_invariants()


def test_swap_round_trip():
    m = mgr_(num_host_blocks=8)
    r = make_request("r", range(10))  # 2 full (cached) + 1 partial
    prefill(m, r)
    hashes = list(m.get_block_hashes("r"))
    assert m.can_swap_out(r)
    out = m.swap_out(r)
    assert out == [(1, 1), (2, 2), (3, 3)] and m.is_swapped("r")
    assert m.get_block_ids("r") == [] and m.get_host_block_ids("r") == [1, 2, 3]
    assert m.num_free_blocks == 16 and m.host_pool.get_num_free_blocks() == 5
    m.check_invariants()
    # Another request reuses device memory: the unhashed block 3 first, then fresh ones.
    other = make_request("o", range(100, 120))  # 5 blocks
    prefill(m, other)
    assert m.get_block_ids("o") == [3, 4, 5, 6, 7]
    assert m.can_swap_in(r)
    back = m.swap_in(r)
    # Blocks 1, 2 were still cached on the device: reused without a copy.
    assert m.get_block_ids("r")[:2] == [1, 2] and back == [(3, m.get_block_ids("r")[2])]
    assert not m.is_swapped("r") and m.host_pool.get_num_free_blocks() == 8
    assert m.get_block_hashes("r") == hashes
    m.check_invariants()
    decode(m, r, 10)
    assert r.num_computed_tokens == 11
    m.free(r)
    m.free(other)
    assert m.num_free_blocks == 16
    m.check_invariants()


def test_swap_in_recaches_blocks_evicted_meanwhile():
    m = mgr_(num_blocks=5, num_host_blocks=4)  # 4 usable device blocks
    r = make_request("r", range(9))
    prefill(m, r)
    m.swap_out(r)
    filler = make_request("f", range(100, 116))  # evicts everything
    prefill(m, filler)
    assert m.pool.cached_block_hash_to_block.keys().isdisjoint(m.get_block_hashes("r"))
    assert not m.can_swap_in(r)
    with pytest.raises(ValueError, match="swap in"):
        m.swap_in(r)
    m.free(filler)
    back = m.swap_in(r)
    assert [h for h, _ in back] == [1, 2, 3] and len(back) == 3
    hits, n = m.get_computed_blocks(make_request("q", range(9)))
    assert n == 8 and hits == m.get_blocks("r")[:2]  # cache hits after swap-in
    m.free(make_request("q", []))
    m.check_invariants()


def test_swap_refusals_and_free_while_swapped():
    m = mgr_(num_host_blocks=2)
    r = make_request("r", range(12))
    prefill(m, r)
    assert not m.can_swap_out(r)
    with pytest.raises(ValueError, match="host blocks"):
        m.swap_out(r)
    small = make_request("s", range(5))
    prefill(m, small)
    m.swap_out(small)
    with pytest.raises(ValueError, match="swapped"):
        m.allocate_slots(small, 1)
    m.free(small)
    assert m.host_pool.get_num_free_blocks() == 2 and not m.is_swapped("s")
    assert not mgr_().can_swap_out(r)  # no host pool
    m.check_invariants()


def test_swap_keeps_null_blocks_null():
    m = mgr_(sliding_window=4, num_host_blocks=8)
    r = make_request("r", range(8))
    prefill(m, r)
    decode(m, r, 8)  # position 8: window 5..8 -> block 0 freed
    assert m.get_block_ids("r") == [0, 2, 3]
    out = m.swap_out(r)
    assert out == [(2, 1), (3, 2)] and m.get_host_block_ids("r") == [0, 1, 2]
    m.check_invariants()
    back = m.swap_in(r)
    assert m.get_block_ids("r")[0] == 0 and len(back) <= 2
    m.check_invariants()


def test_events_through_manager():
    m = mgr_(enable_kv_cache_events=True, num_blocks=4)
    r = make_request("r", range(9))
    prefill(m, r)
    ev = m.take_events()
    assert len(ev) == 1 and isinstance(ev[0], BlockStored)
    hashes = list(m.get_block_hashes("r"))
    assert ev[0].token_ids == list(range(8)) and ev[0].block_hashes == hashes
    assert ev[0].parent_block_hash is None and ev[0].block_size == BS
    assert ev[0].extra_keys == [None, None]
    m.free(r)
    prefill(m, make_request("x", range(50, 62)))  # reuses all 3 blocks: 2 evictions
    removed = [e for e in m.take_events() if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(hashes)
    m.check_invariants()


def test_events_carry_the_requests_salt_and_lora_as_vllms_extra_keys():
    m = mgr_(enable_kv_cache_events=True)
    prefill(m, make_request("s", range(13), cache_salt="t1"))
    prefill(m, make_request("l", range(13), lora_name="ad", cache_salt="t2"))
    salted, lora = m.take_events()
    assert salted.extra_keys == [("t1",), None, None]  # the salt keys the first block only
    assert lora.extra_keys == [("ad", "t2"), ("ad",), ("ad",)]
    assert salted.block_hashes == list(m.get_block_hashes("s"))
    m.check_invariants()


def test_reset_prefix_cache():
    m = mgr_()
    r = make_request("r", range(9))
    prefill(m, r)
    assert m.reset_prefix_cache() is False
    m.free(r)
    assert m.reset_prefix_cache() is True
    assert m.get_computed_blocks(make_request("q", range(9))) == ([], 0)
    m.check_invariants()


def test_bad_arguments_rejected_by_name():
    for kw, name in [({"block_size": 0}, "block_size"), ({"watermark": 1.5}, "watermark"),
                     ({"num_host_blocks": -1}, "num_host_blocks"),
                     ({"sliding_window": 0}, "sliding_window"), ({"hash_algo": "md5"}, "md5"),
                     ({"num_blocks": 1}, "num_blocks")]:
        args = {"num_blocks": 8, "block_size": 4} | kw
        with pytest.raises(ValueError, match=name):
            KVCacheManager(**args)
    m = mgr_()
    with pytest.raises(ValueError, match="negative"):
        m.allocate_slots(make_request("r", range(4)), -1)
    m.check_invariants()


def test_allocate_slots_rejects_misplaced_hits():
    m = mgr_()
    a = make_request("a", range(9))
    prefill(m, a)
    b = make_request("b", range(9))
    hits, n = m.get_computed_blocks(b)
    with pytest.raises(ValueError, match="new_computed_blocks"):
        m.allocate_slots(b, 1, hits, n - 1)
    assert hits[0].ref_cnt == 1 and m.get_block_ids("b") == []
    m.free(b)
    m.check_invariants()


def test_sliding_window_frees_a_block_exactly_when_it_leaves_the_window():
    """Window 8, block size 4: the token at position p attends to p-7..p, so block 0 (positions
    0..3) is needed up to p = 10 and free from p = 11 on, not a step earlier or later."""
    m = mgr_(sliding_window=8)
    r = make_request("r", range(10))
    prefill(m, r)
    assert m.get_block_ids("r") == [1, 2, 3]
    decode(m, r, 10)  # computes position 10: window 3..10 still holds position 3
    assert m.get_block_ids("r") == [1, 2, 3] and m.num_free_blocks == 13
    decode(m, r, 11)  # computes position 11: window 4..11
    assert m.get_block_ids("r") == [0, 2, 3] and m.num_free_blocks == 14
    decode(m, r, 12)
    decode(m, r, 13)
    decode(m, r, 14)  # computes position 14: window 7..14 still holds position 7 (block 1)
    assert m.get_block_ids("r")[:2] == [0, 2]
    decode(m, r, 15)  # position 15: window 8..15
    assert m.get_block_ids("r")[:2] == [0, 0]
    m.check_invariants()


def _swapped_with_cached_prefix(num_blocks: int) -> tuple[KVCacheManager, object]:
    """A 9-token request (2 full cached blocks + 1 partial) swapped out; its 2 full device
    blocks stay cached in the free queue (ref 0)."""
    m = mgr_(num_blocks=num_blocks, num_host_blocks=4)
    r = make_request("r", range(9))
    prefill(m, r)
    m.swap_out(r)
    assert m.num_free_blocks == num_blocks - 1
    return m, r


def test_swap_in_counts_a_free_cached_hit_as_one_block():
    """Swapping back 3 host blocks whose 2 full ones are still cached but held by nobody needs
    3 free blocks: a hit taken from the free queue costs a free block as a fresh one does."""
    m, r = _swapped_with_cached_prefix(num_blocks=11)  # 10 usable
    filler = make_request("f", range(100, 128))  # 7 blocks: takes the uncached ones first
    prefill(m, filler, use_cache=False)
    cached = m.pool.cached_block_hash_to_block
    assert m.num_free_blocks == 3 and all(h in cached for h in m.get_block_hashes("r")[:2])
    assert m.can_swap_in(r)
    decode(m, filler, 128)  # one more block for the filler: 2 free
    assert m.num_free_blocks == 2 and all(h in cached for h in m.get_block_hashes("r")[:2])
    assert not m.can_swap_in(r)
    with pytest.raises(ValueError, match="swap in"):
        m.swap_in(r)
    m.check_invariants()


def test_swap_in_counts_a_held_cached_hit_as_free():
    """The same, but another request holds the 2 cached blocks: only the partial block needs
    a free block, so swap-in fits with exactly 1 free block."""
    m, r = _swapped_with_cached_prefix(num_blocks=11)
    sharer = make_request("s", list(range(8)) + [50])  # hits blocks 1, 2
    new, hit = prefill(m, sharer)
    assert hit == 8 and len(new) == 1
    filler = make_request("f", range(100, 124))  # 6 blocks: 1 free left
    prefill(m, filler, use_cache=False)
    assert m.num_free_blocks == 1
    assert m.can_swap_in(r)
    back = m.swap_in(r)
    assert len(back) == 1 and m.get_block_ids("r")[:2] == m.get_block_ids("s")[:2]
    assert m.num_free_blocks == 0
    m.check_invariants()


@pytest.mark.parametrize("held_by_a_request", [True, False])
def test_unpin_frees_tail_first_so_the_prefix_head_survives(held_by_a_request):
    """Unpinning hands the prefix back tail first, like a finished request: the pressure that
    follows evicts the prefix's last blocks and its head still hits. Pinned while a request
    still held the blocks, or after it had freed them (an unpinned, merely cached prefix)."""
    m = mgr_(num_blocks=6, max_pinned_fraction=0.9)  # 5 usable
    prompt = range(16)  # 4 full blocks
    a = make_request("a", prompt)
    prefill(m, a)
    if held_by_a_request:
        m.pin_prefix(prompt)
        m.free(a)
        assert [b.block_id for b in m.pool.eviction.free_blocks()] == [5]
    else:
        m.free(a)
        m.pin_prefix(prompt)
    m.check_invariants()
    m.unpin_prefix(prompt)
    assert [b.block_id for b in m.pool.eviction.free_blocks()] == [5, 4, 3, 2, 1]
    b = make_request("b", range(100, 108))  # two new blocks: evicts the prefix's tail (4)
    prefill(m, b)
    hits, n = m.get_computed_blocks(make_request("c", prompt))
    assert [x.block_id for x in hits] == [1, 2, 3] and n == 12
    m.check_invariants()
