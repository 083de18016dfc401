"""KV cache groups (kv/hybrid_spec.py, kv/coordinator.py): the grouping rule, the bytes it saves,
each attention type's prefix-hit rule, all-or-nothing allocation, and group-tagged events."""

from __future__ import annotations

from pagedkv.kv.coordinator import HybridKVCacheManager
from pagedkv.kv.events import BlockRemoved, BlockStored
from pagedkv.kv.factory import make_kv_cache_manager
from pagedkv.kv.hashing import group_key_suffix
from pagedkv.kv.hf_spec import kv_cache_spec_from_hf_config
from pagedkv.kv.hybrid_spec import hybrid_kv_cache_spec, sequence_capacity
from pagedkv.kv.manager import AllocStatus
from tests.kv.conftest import make_request, prefill

GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
             "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
             "head_dim": 256, "hidden_size": 1152, "sliding_window": 512,
             "sliding_window_pattern": 6, "torch_dtype": "bfloat16"}


def test_gemma3_groups_and_bytes_at_32k():
    spec = kv_cache_spec_from_hf_config(GEMMA3_1B, block_size=16)
    full = [g for g in spec.groups if g.sliding_window is None]
    # 26 layers, every 6th full: 4 full + 22 sliding; group size 4 -> 1 full + 6 sliding groups
    assert spec.num_layers == 4 and len(full) == 1 and len(spec.groups) == 7
    assert full[0].layer_ids == (5, 11, 17, 23)
    assert sorted(i for g in spec.groups for i in g.layer_ids) == list(range(26))
    assert spec.page_size_bytes == 16 * 4 * 2 * 1 * 256 * 2  # block 16, 4 layers, bf16
    per_seq = spec.max_blocks_per_seq(32768) * spec.page_size_bytes
    all_full = 32768 * 26 * 2 * 256 * 2
    assert spec.max_blocks_per_seq(32768) == 2048 + 6 * (512 // 16 + 1)
    assert all_full / per_seq > 5  # ~5.5x less KV per 32k sequence
    # One sequence's capacity in 1,000 blocks: the windows set aside, the rest for the full group.
    assert sequence_capacity(spec, 1000) == (1000 - 6 * 33) * 16


def test_group_size_rule():
    # 13 + 13 (Gemma 2): two groups of 13; 1 + 5: six groups of one layer; 10 + 12: 12-layer
    # groups (12 < 1.25 x 10), the full one padded.
    two = hybrid_kv_cache_spec((4, None) * 13, block_size=4, num_kv_heads=1, head_size=4,
                               dtype="float32")
    assert [len(g.layer_ids) for g in two.groups] == [13, 13]
    assert [len(g.layer_ids) for g in hybrid_kv_cache_spec(
        (4,) * 5 + (None,), block_size=4, num_kv_heads=1, head_size=4,
        dtype="float32").groups] == [1] * 6
    padded = hybrid_kv_cache_spec((None,) * 10 + (4,) * 12, block_size=4, num_kv_heads=1,
                                  head_size=4, dtype="float32")
    assert padded.num_layers == 12 and [len(g.layer_ids) for g in padded.groups] == [10, 12]
    assert hybrid_kv_cache_spec((None, None), block_size=4, num_kv_heads=1, head_size=4,
                                dtype="float32") is None


def _manager(num_blocks: int = 64, **kw) -> HybridKVCacheManager:
    spec = hybrid_kv_cache_spec((None, 8), block_size=4, num_kv_heads=1, head_size=4,
                                dtype="float32")
    mgr = make_kv_cache_manager(spec, num_blocks=num_blocks, **kw)
    assert isinstance(mgr, HybridKVCacheManager)
    return mgr


def test_prefix_hit_is_what_every_group_serves():
    mgr = _manager()
    full = mgr.groups[0]
    a = make_request("a", range(100, 141))  # 41 tokens: 10 full blocks
    prefill(mgr, a)
    mgr.free(a)
    # Everything cached in both groups: hit 10 blocks (the last token is recomputed).
    b = make_request("b", list(range(100, 141)) + [7])
    hits, n = mgr.get_computed_blocks(b)
    assert n == 40 and [len(h) for h in hits] == [10, 10]
    # The sliding group only needs the blocks of the window before the hit point
    # (positions 33..39: blocks 8 and 9); the rest are the null block.
    assert all(blk.is_null for blk in hits[1][:8]) and not any(blk.is_null for blk in hits[1][8:])
    mgr.free(b)
    # Evict the sliding group's copy of an early block: still a full hit (out of the window).
    pool = mgr.pool
    hashes = full.hasher(b, [])
    assert all(hashes[i] + group_key_suffix(1) in pool.cached_block_hash_to_block
               for i in range(10))

    def evict(block_index: int) -> None:
        block = pool.cached_block_hash_to_block[hashes[block_index] + group_key_suffix(1)]
        pool.touch([block])
        pool.free_blocks([block])
        pool._evict(block)

    evict(2)
    c = make_request("c", list(range(100, 141)) + [8])
    assert mgr.get_computed_blocks(c)[1] == 40
    mgr.free(c)
    # Evict the sliding group's block 9: the hit falls back to block 8's end minus the window:
    # blocks 6 and 7 are there (block 8 too): hit point 9 blocks = 36 tokens.
    evict(9)
    d = make_request("d", list(range(100, 141)) + [9])
    hits, n = mgr.get_computed_blocks(d)
    assert n == 36 and [len(h) for h in hits] == [9, 9]
    mgr.free(d)
    mgr.check_invariants()


def test_allocation_is_all_or_nothing():
    mgr = _manager(num_blocks=12, max_num_batched_tokens=8)  # 11 usable
    a = make_request("a", range(1, 25))  # 24 tokens: 6 blocks per group = 12 > 11
    # at most 6 full + (2 window + 1 + 2 chunk) sliding blocks at once
    assert mgr.peak_blocks(24) == 11 and mgr.can_allocate(a) is AllocStatus.OK
    assert _manager(num_blocks=12).can_allocate(a) is AllocStatus.NEVER  # one-shot prefill
    assert mgr.allocate_slots(a, 24) is None
    assert mgr.get_group_block_ids("a") == [[], []] and mgr.num_free_blocks == 11
    assert mgr.allocate_slots(a, 12) is not None  # a chunk: 3 + 3 blocks
    a.num_computed_tokens = 12
    assert mgr.allocate_slots(a, 12) is not None  # the window freed sliding blocks 0..0
    assert mgr.get_group_block_ids("a")[1][0] == 0
    mgr.free(a)
    assert mgr.num_free_blocks == 11
    mgr.check_invariants()


def test_events_carry_group_and_kind_with_plain_hashes():
    mgr = _manager(num_blocks=20, enable_kv_cache_events=True)
    a = make_request("a", range(1, 18))  # 4 full blocks
    prefill(mgr, a)
    events = mgr.take_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert {(e.group_idx, e.kv_cache_spec_kind) for e in stored} == \
        {(0, "full_attention"), (1, "sliding_window")}
    by_group = {g: [h for e in stored if e.group_idx == g for h in e.block_hashes] for g in (0, 1)}
    assert by_group[0] == by_group[1] == mgr.get_block_hashes("a")[:4]
    mgr.free(a)
    b = make_request("b", range(50, 82))  # 8 + 8 blocks of 19: evicts cached ones
    prefill(mgr, b)
    removed = [e for e in mgr.take_events() if isinstance(e, BlockRemoved)]
    assert removed and all(h in by_group[e.group_idx] for e in removed for h in e.block_hashes)
    mgr.free(b)
    mgr.check_invariants()


def test_pins_hold_each_groups_blocks_by_its_hit_rule():
    """A pin of a 41-token prompt (10 full blocks) holds the full group's 10 blocks and the
    sliding group's last 2 (window 8, block 4): a flood evicts everything else, the prefix
    still hits whole; unpinning gives every block back."""
    mgr = _manager(max_pinned_fraction=0.5)
    prompt = list(range(1, 42))
    a = make_request("a", prompt)
    prefill(mgr, a)
    hashes = list(mgr.get_block_hashes("a"))
    mgr.free(a)
    info = mgr.pin_prefix(prompt)
    assert (info.num_blocks, info.num_tokens, info.num_prompt_blocks) == (12, 40, 10)
    assert mgr.num_pinned_blocks == 12
    mgr.check_invariants()
    for i in range(3):  # 22 blocks each, 51 not pinned: every unpinned block is reused
        flood = make_request(f"f{i}", range(100 + 50 * i, 141 + 50 * i))
        assert prefill(mgr, flood)[0] is not None
        mgr.free(flood)
        mgr.check_invariants()
    sliding = group_key_suffix(1)
    assert mgr.pool.get_cached_block(hashes[0] + sliding) is None  # evicted: not pinned
    assert mgr.pool.get_cached_block(hashes[9] + sliding) is not None  # pinned
    c = make_request("c", prompt + [500, 501])
    assert prefill(mgr, c)[1] == 40
    mgr.free(c)
    info = mgr.unpin_prefix(prompt)
    assert (info.num_blocks, info.total_pinned_blocks) == (0, 0)
    mgr.check_invariants()
    assert mgr.num_free_blocks == mgr.num_usable_blocks


def test_sub_block_hit_copies_every_groups_partial_block():
    """prefix_match_unit=1: a finished request's partly filled last block, in every group, serves
    the next requests' hits to the token: each request gets its own copy in each group (the full
    group after all its blocks, the sliding one after its window's), the cached blocks stay."""
    mgr = _manager(prefix_match_unit=1)
    a = make_request("a", range(10, 32))  # 22 tokens: 5 full blocks + 2
    prefill(mgr, a)
    mgr.take_block_copies()
    mgr.free(a)
    sources = None
    tables, reqs = [], []
    for rid, tail in (("b", [99, 98]), ("c", [7])):
        req = make_request(rid, list(range(10, 32)) + tail)
        hits, n = mgr.get_computed_blocks(req)
        assert n == 22 and [len(h) for h in hits] == [6, 6]
        assert all(b.is_null for b in hits[1][:3])  # before the window (8): nulls
        assert sources in (None, [h[5].block_id for h in hits])
        sources = [h[5].block_id for h in hits]
        mgr.allocate_slots(req, req.num_tokens - n, hits, n)
        req.num_computed_tokens = req.num_tokens
        copies = mgr.take_block_copies()
        ids = mgr.get_group_block_ids(rid)
        assert sorted(copies) == sorted(zip(sources, [t[5] for t in ids], strict=True))
        tables.append(ids)
        reqs.append(req)
        mgr.check_invariants()
    assert all(b[5] != c[5] for b, c in zip(*tables, strict=True))  # own copies
    for req in reqs:
        mgr.free(req)
    mgr.check_invariants()
    assert mgr.num_free_blocks == mgr.num_usable_blocks
