"""The KV store with KV cache groups (a tiny Gemma 3: five sliding layers, window 8, per full
one; block 4): every group's blocks are saved under keys naming the group, a lookup and a load
follow each group's hit rule (a sliding group brings back only the blocks its window reaches),
greedy tokens equal transformers', and a grouped store and an all-full one never read each
other's blocks."""

from __future__ import annotations

import pytest

from pagedkv.kv.coordinator import HybridKVCacheManager
from tests.engine.conftest import hf_greedy
from tests.store.conftest import (
    PREFIX_LEN,
    SlowTier,
    make_prefixes,
    run_one,
    store_llm,
    with_suffix,
)

# One request of 45 tokens holds at most 12 full-group blocks plus 5 x 5 sliding ones (chunks
# of 8 tokens); 44 usable blocks.
GROUPED = dict(num_gpu_blocks_override=45, max_num_batched_tokens=8)
FULL_BLOCKS = PREFIX_LEN // 4  # 10 prefix blocks
WINDOW_BLOCKS = 2  # cdiv(8 - 1, 4): the blocks a sliding group needs before a hit point


def _url(tier, request):
    return request.getfixturevalue("redis_server").url if tier == "redis" else None


def _drop_device_cache(llm) -> None:
    kv = llm.llm_engine.scheduler.kv_cache_manager
    assert kv.reset_prefix_cache()
    kv.check_invariants()


@pytest.mark.parametrize("tier", ["host", "disk", "redis"])
def test_groups_come_back_from_the_tier_by_their_hit_rule(tiny_gemma3, tmp_path, tier,
                                                          request):
    llm = store_llm(tiny_gemma3, tier, tmp_path, _url(tier, request), **GROUPED)
    assert isinstance(llm.llm_engine.scheduler.kv_cache_manager, HybridKVCacheManager)
    store = llm.llm_engine.kv_store
    prefixes = make_prefixes(seed=3, num=2)
    for prefix in prefixes:  # round 1 computes and saves every group's blocks
        prompt = with_suffix(prefix, seed=1)
        assert run_one(llm, prompt) == (hf_greedy(tiny_gemma3, prompt, 4), 0)
    written = store.snapshot_stats()[0].blocks_written
    # Every full block of every group was saved (45 prompt + 4 generated tokens: 12 blocks),
    # the sliding groups' too, before the window let them go.
    assert written == 2 * 6 * 12
    _drop_device_cache(llm)
    for i, prefix in enumerate(prefixes):  # round 2: only from the tier
        prompt = with_suffix(prefix, seed=10 + i)
        assert run_one(llm, prompt) == (hf_greedy(tiny_gemma3, prompt, 4), PREFIX_LEN)
        _drop_device_cache(llm)
    stats = store.snapshot_stats()[0]
    # Per prefix: the full group's 10 blocks, and 2 per sliding group (not all 10 of each).
    assert stats.hits == 2 * (FULL_BLOCKS + 5 * WINDOW_BLOCKS)
    assert stats.bytes_read == stats.hits * store.block_bytes
    connector = llm.llm_engine.scheduler.kv_connector
    assert connector.num_loaded_tokens == 2 * PREFIX_LEN
    assert connector.num_failed_load_tokens == 0
    assert llm.llm_engine.scheduler.prefix_cache_hits == 0  # nothing from the device cache


class _HidingTier(SlowTier):
    """A tier that has lost some keys (answers misses for them)."""

    def __init__(self, inner, hidden: set[bytes]) -> None:
        super().__init__(inner)
        self.hidden = hidden

    def contains_many(self, keys):
        return [k not in self.hidden and found
                for k, found in zip(keys, super().contains_many(keys), strict=True)]

    def get_many(self, keys):
        return [None if k in self.hidden else p
                for k, p in zip(keys, super().get_many(keys), strict=True)]


@pytest.mark.parametrize("lost, hit_blocks", [
    ((9, 3), 9),  # a sliding group's last block: the hit ends where its window is whole
    ((5, 3), 10),  # a sliding group's block outside the window at block 10: not needed
    ((5, 0), 5),  # the full group's block 5: every later block needs it
])
def test_a_lost_block_costs_what_its_group_rule_says(tiny_gemma3, tmp_path, lost, hit_blocks):
    llm = store_llm(tiny_gemma3, "host", tmp_path, **GROUPED)
    store = llm.llm_engine.kv_store
    prefix = make_prefixes(seed=4, num=1)[0]
    run_one(llm, with_suffix(prefix, seed=1))
    _drop_device_cache(llm)
    block, group = lost
    hashes = llm.llm_engine.scheduler.kv_cache_manager.groups[0].recent_prompts[-1].block_hashes
    store.tiers[0] = _HidingTier(store.tiers[0], {store.key(hashes[block], group)})
    prompt = with_suffix(prefix, seed=2)
    assert run_one(llm, prompt) == (hf_greedy(tiny_gemma3, prompt, 4), hit_blocks * 4)


def test_a_block_lost_during_the_load_is_recomputed(tiny_gemma3, tmp_path):
    """The lookup saw every block; a sliding group's block is gone when the load runs: the
    blocks that arrived serve no hit point by every group's rule (a shorter hit needs other
    window blocks than the ones loaded), so the whole prompt is computed, tokens unchanged,
    and the blocks allocated for the load go back to the pool."""
    llm = store_llm(tiny_gemma3, "host", tmp_path, **GROUPED)
    store = llm.llm_engine.kv_store
    prefix = make_prefixes(seed=5, num=1)[0]
    run_one(llm, with_suffix(prefix, seed=1))
    _drop_device_cache(llm)
    hashes = llm.llm_engine.scheduler.kv_cache_manager.groups[0].recent_prompts[-1].block_hashes
    tier = store.tiers[0] = _HidingTier(store.tiers[0], set())
    tier.before_load = lambda: tier.hidden.add(store.key(hashes[9], 3))
    prompt = with_suffix(prefix, seed=2)
    assert run_one(llm, prompt) == (hf_greedy(tiny_gemma3, prompt, 4), 0)
    connector = llm.llm_engine.scheduler.kv_connector
    assert (connector.num_loaded_tokens, connector.num_failed_load_tokens) == (0, PREFIX_LEN)
    kv = llm.llm_engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_grouped_and_all_full_stores_never_read_each_other(tiny_gemma3, tmp_path):
    """One disk directory, the same model: a block of the grouped layout holds a group's four
    layers, one of the all-full layout all six, so their keys differ (the layout is part of
    the store's model identity); each layout finds only its own blocks."""
    prompt = with_suffix(make_prefixes(seed=6, num=1)[0], seed=1)
    full = dict(disable_hybrid_kv_cache_manager=True)
    runs = []
    for kwargs in (full, GROUPED, GROUPED, full):  # writes, misses, hits, hits
        llm = store_llm(tiny_gemma3, "disk", tmp_path, **kwargs)
        runs.append((llm.llm_engine.kv_store.identity, run_one(llm, prompt)))
        del llm
    expected, hit = hf_greedy(tiny_gemma3, prompt, 4), (len(prompt) - 1) // 4 * 4
    assert [r[1] for r in runs] == [(expected, 0), (expected, 0), (expected, hit),
                                    (expected, hit)]
    assert runs[0][0] == runs[3][0] != runs[1][0] == runs[2][0]


def test_sub_block_hit_on_the_device_then_whole_blocks_from_the_store(tiny_gemma3, tmp_path):
    """prefix_match_unit=1: a device hit inside a block (every group's partial block copied)
    does not ask the store (whole blocks); once the device cache is gone the store serves the
    whole blocks as before. Tokens equal transformers' throughout."""
    llm = store_llm(tiny_gemma3, "host", tmp_path, prefix_match_unit=1, **GROUPED)
    connector = llm.llm_engine.scheduler.kv_connector
    prefix = make_prefixes(seed=4, num=1)[0]
    first = with_suffix(prefix, seed=1, length=6)  # 46 tokens; 49 computed: 12 blocks + 1
    tokens, cached = run_one(llm, first)
    assert (tokens, cached) == (hf_greedy(tiny_gemma3, first, 4), 0)
    lookups = connector.num_lookups
    second = first + tokens[:3] + [7, 8]
    assert run_one(llm, second) == (hf_greedy(tiny_gemma3, second, 4), 49)
    assert connector.num_lookups == lookups  # the hit ended inside a block: no store lookup
    _drop_device_cache(llm)
    third = with_suffix(prefix, seed=2, length=6)
    assert run_one(llm, third) == (hf_greedy(tiny_gemma3, third, 4), PREFIX_LEN)
    _drop_device_cache(llm)
