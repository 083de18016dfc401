"""BlockPool and its LRU eviction order (FreeBlockQueue): allocation order, lazy eviction, touch, events, invariants."""

import pytest

from pagedkv.kv.block import KVCacheBlock
from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from pagedkv.kv.eviction import EvictionPolicy, FreeBlockQueue

BS = 4


def ids(blocks):
    return [b.block_id for b in blocks]


def h(i: int) -> bytes:
    return bytes([i]) * 32


def cache(pool, blocks, first_hash=0):
    """Register `blocks` as one request's full blocks with hashes h(first_hash + i)."""
    hashes = [h(first_hash + i) for i in range(len(blocks))]
    tokens = list(range(len(blocks) * BS))
    pool.cache_full_blocks(blocks, hashes, 0, len(blocks), BS, tokens)
    return hashes


def test_free_queue_order_remove_and_empty_pop():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.num_free_blocks == 5 and ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert ids(q.get_all_free_blocks()) == [0, 1, 3, 4] and len(q) == 4
    assert ids(q.popleft_n(3)) == [0, 1, 3]
    q.append_n([blocks[1], blocks[3], blocks[0]])
    assert ids(q.get_all_free_blocks()) == [4, 1, 3, 0] and q.num_free_blocks == 4
    assert ids(q.popleft_n(4)) == [4, 1, 3, 0]
    with pytest.raises(ValueError):
        q.popleft_n(1)
    with pytest.raises(ValueError):
        q.remove(blocks[0])
    q.append_n([])
    assert q.get_all_free_blocks() == [] and len(q) == 0


class _FIFO(EvictionPolicy):
    """A toy policy (reuse in freeing order, hashed or not): only the interface is used."""

    def __init__(self, blocks):
        self.order = list(blocks)

    @property
    def num_free_blocks(self):
        return len(self.order)

    def add(self, blocks):
        self.order.extend(blocks)

    def remove(self, blocks):
        for b in blocks:
            self.order.remove(b)

    def pop(self, num_blocks):
        out, self.order = self.order[:num_blocks], self.order[num_blocks:]
        return out

    def free_blocks(self):
        return list(self.order)


def test_pool_bookkeeping_is_independent_of_the_eviction_policy():
    pool = BlockPool(6, enable_caching=True, eviction_policy=_FIFO)
    blocks = pool.get_new_blocks(4)  # 1 2 3 4
    hashes = cache(pool, blocks[:2])
    pool.free_blocks(reversed(blocks))  # FIFO: 5, then 4 3 2 1 (no head rule for unhashed)
    assert ids(pool.eviction.free_blocks()) == [5, 4, 3, 2, 1]
    pool.check_invariants([])
    pool.touch([pool.get_cached_block(hashes[0])])  # a hit takes block 1 back
    assert ids(pool.eviction.free_blocks()) == [5, 4, 3, 2] and blocks[0].ref_cnt == 1
    got = pool.get_new_blocks(4)  # 5 4 3 2: block 2 is evicted from the cache
    assert ids(got) == [5, 4, 3, 2] and pool.get_cached_block(hashes[1]) is None
    pool.check_invariants([[blocks[0]], got])


def test_null_block_never_handed_out():
    pool = BlockPool(5, enable_caching=True)
    got = pool.get_new_blocks(4)
    assert ids(got) == [1, 2, 3, 4] and all(b.ref_cnt == 1 for b in got)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 0 and pool.get_usage() == 1.0
    with pytest.raises(ValueError, match="cannot allocate 1"):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([pool.null_block])
    pool.check_invariants([got])


def test_double_free_raises():
    pool = BlockPool(4, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(ValueError, match="double free of block 1"):
        pool.free_blocks([b])
    pool.check_invariants([])


def test_lru_order_and_tail_first_eviction():
    pool = BlockPool(8, enable_caching=True)
    req1 = pool.get_new_blocks(3)  # 1 2 3
    req2 = pool.get_new_blocks(3)  # 4 5 6
    cache(pool, req1, 0)
    cache(pool, req2, 10)
    pool.free_blocks(reversed(req1))  # tail first: 3 2 1 -> queue 7 3 2 1
    pool.free_blocks(reversed(req2))  # later: 6 5 4
    assert ids(pool.eviction.free_blocks()) == [7, 3, 2, 1, 6, 5, 4]
    pool.check_invariants([])
    # Reuse evicts the least recently freed request first, its tail block before its prefix.
    got = pool.get_new_blocks(3)
    assert ids(got) == [7, 3, 2]
    assert pool.get_cached_block(h(2)) is None and pool.get_cached_block(h(1)) is None
    assert pool.get_cached_block(h(0)) is req1[0]  # prefix block survives
    pool.check_invariants([got])


def test_unhashed_blocks_reused_before_cached_ones():
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(4)  # 1 2 3 4
    cache(pool, blocks[:2])  # 1, 2 full and cached; 3, 4 partial
    pool.free_blocks(reversed(blocks))  # 4 (head), 3 (head), 2 (tail), 1 (tail)
    assert ids(pool.eviction.free_blocks()) == [3, 4, 5, 2, 1]
    assert ids(pool.get_new_blocks(3)) == [3, 4, 5]
    assert pool.get_cached_block(h(0)) is blocks[0]
    assert pool.get_cached_block(h(1)) is blocks[1]
    pool.check_invariants()


def test_lazy_eviction_keeps_hash_until_reuse_and_hit_revives():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    hashes = cache(pool, blocks)
    pool.free_blocks(reversed(blocks))
    assert pool.get_num_free_blocks() == 3 and pool.get_usage() == 0.0
    assert blocks[0].block_hash == hashes[0]  # still cached while free
    hit = pool.get_cached_block(hashes[0])
    assert hit is blocks[0]
    pool.touch([hit])  # revived: leaves the free queue
    assert hit.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    assert hit not in pool.eviction.free_blocks()
    pool.check_invariants([[hit]])
    # The other one is evicted when its memory is reused.
    got = pool.get_new_blocks(2)
    assert blocks[1] in got and blocks[1].block_hash is None
    assert pool.get_cached_block(hashes[1]) is None
    pool.check_invariants([[hit], got])


def test_touch_in_use_block_only_increments_ref():
    pool = BlockPool(4, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2 and pool.get_num_free_blocks() == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.check_invariants([[b]])


def test_duplicate_hash_leaves_second_block_unhashed():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [h(9)], 0, 1, BS)
    pool.cache_full_blocks([b], [h(9)], 0, 1, BS)
    assert pool.get_cached_block(h(9)) is a and b.block_hash is None
    pool.check_invariants([[a], [b]])


def test_events_stored_removed_cleared():
    pool = BlockPool(4, enable_caching=True, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(3)
    hashes = [h(1), h(2), h(3)]
    tokens = list(range(100, 112))
    pool.cache_full_blocks(blocks, hashes, 0, 2, BS, tokens)
    pool.cache_full_blocks(blocks, hashes, 2, 3, BS, tokens)
    ev = pool.take_events()
    # vLLM's shape: one extra_keys entry per block, None where a block has none.
    assert ev == [BlockStored(hashes[:2], None, tokens[:8], BS, extra_keys=[None, None]),
                  BlockStored([hashes[2]], hashes[1], tokens[8:12], BS, extra_keys=[None])]
    assert pool.take_events() == []
    pool.free_blocks(reversed(blocks))
    pool.get_new_blocks(1)  # evicts the tail-first-freed last block (hash 3)
    assert pool.take_events() == [BlockRemoved([hashes[2]])]
    pool.check_invariants()


def test_stored_events_carry_the_salt_and_lora_as_vllm_extra_keys():
    pool = BlockPool(6, enable_caching=True, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(3)
    hashes = [h(1), h(2), h(3)]
    tokens = list(range(100, 112))
    pool.cache_full_blocks(blocks, hashes, 0, 2, BS, tokens, cache_salt="tenant")
    pool.cache_full_blocks(blocks, hashes, 2, 3, BS, tokens, cache_salt="tenant")
    first, second = pool.take_events()
    assert first.extra_keys == [("tenant",), None]  # the salt keys the first block only
    assert second.extra_keys == [None]
    more = pool.get_new_blocks(2)
    pool.cache_full_blocks(more, [h(4), h(5)], 0, 2, BS, tokens, cache_salt="s", lora_name="ad")
    (stored,) = pool.take_events()
    assert stored.extra_keys == [("ad", "s"), ("ad",)]  # vLLM's order: LoRA, then salt
    assert [b.block_hash for b in blocks + more] == hashes + [h(4), h(5)]  # hashes as given
    pool.check_invariants([blocks, more])


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(4, enable_caching=True, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(2)
    cache(pool, blocks)
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {} and all(b.block_hash is None for b in blocks)
    assert pool.take_events() == [AllBlocksCleared()]
    pool.check_invariants([])


def test_caching_disabled_registers_nothing():
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    cache(pool, blocks)
    assert pool.get_cached_block(h(0)) is None and blocks[0].block_hash is None
    pool.check_invariants([blocks])


def test_check_invariants_detects_violations():
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    with pytest.raises(RuntimeError, match="ref_cnt 1 but 0 block-table"):
        pool.check_invariants([[blocks[0]]])
    with pytest.raises(RuntimeError, match="ref_cnt 1 but 2"):
        pool.check_invariants([[blocks[0], blocks[0]], [blocks[1]]])
    blocks[0].ref_cnt = 0  # corrupt: ref 0 but not in the free queue
    with pytest.raises(RuntimeError, match="not in the free queue"):
        pool.check_invariants()
    blocks[0].ref_cnt = 1
    pool.cached_block_hash_to_block[h(5)] = blocks[1]  # corrupt: wrong hash mapping
    with pytest.raises(RuntimeError, match="maps to block 2"):
        pool.check_invariants()
    del pool.cached_block_hash_to_block[h(5)]
    pool.eviction.num_free_blocks += 1
    with pytest.raises(RuntimeError, match="num_free_blocks"):
        pool.check_invariants()
    pool.eviction.num_free_blocks -= 1
    pool.check_invariants([blocks])


def test_bad_pool_size_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1, enable_caching=True)
