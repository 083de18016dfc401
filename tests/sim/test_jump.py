"""Jumping over quiet stretches equals stepping one by one: same per-request times, tokens,
hits and preemptions, same ITL samples, same prefix cache and pool at the end."""

from __future__ import annotations

import dataclasses

import pytest

from pagedkv.sim.config import SimConfig
from pagedkv.sim.latency import FunctionLatency, StepShape
from pagedkv.sim.simulator import simulate
from pagedkv.sim.store import TierSpec
from pagedkv.sim.traces import TraceRequest
from tests.sim.workloads import shared_prefix_trace


def step_time(shape: StepShape) -> float:
    return 1e-3 + 2e-4 * shape.prefill_tokens + 1e-4 * shape.decode_seqs \
        + 1e-6 * shape.decode_context


def long_outputs(num: int = 40) -> list[TraceRequest]:
    trace = shared_prefix_trace(num=num, seed=3, block_tokens=8, gap=0.05)
    return [dataclasses.replace(r, output_length=r.output_length * 4) for r in trace]


def _itl(instance) -> list[float]:
    out = []
    for value, weight in zip(instance.stats.itl_values, instance.stats.itl_weights, strict=True):
        out += [value] * int(weight)
    return sorted(out)


@pytest.mark.parametrize("settings", [
    dict(num_blocks=400, max_num_seqs=8),  # roomy: long quiet decode stretches
    dict(num_blocks=60, max_num_seqs=16),  # tight: admission refused (LATER), preemptions
    dict(num_blocks=200, max_num_seqs=3),  # sequence-bound: a waiting queue never looked at
    dict(num_blocks=60, max_num_seqs=6, preemption_mode="swap", num_host_blocks=40),
    dict(num_blocks=120, max_num_seqs=6, eviction_policy="lfu", block_size=4),
    dict(num_blocks=60, max_num_seqs=16, block_bytes=4096,  # the KV store's saves and loads
         store_tiers=(TierSpec("host", 40, 1e9, 1e-4), TierSpec("disk", 400, 1e8, 1e-3))),
    dict(num_blocks=60, max_num_seqs=16, scheduling_policy="priority"),
])
def test_jumping_equals_stepping(settings):
    trace = long_outputs()
    base = dict(block_size=8, max_num_batched_tokens=32, max_model_len=512, vocab_size=500)
    results = {}
    for jump in (False, True):
        config = SimConfig(**{**base, **settings, "jump": jump})
        results[jump] = simulate(trace, config, FunctionLatency(step_time), num_instances=1)
    stepped, jumped = results[False], results[True]
    si, ji = stepped.instances[0], jumped.instances[0]
    assert ji.stats.num_jumped_steps > 0 and si.stats.num_jumped_steps == 0
    assert ji.stats.num_steps == si.stats.num_steps
    assert [dataclasses.asdict(r) for r in jumped.records] == \
        [dataclasses.asdict(r) for r in stepped.records]
    assert _itl(ji) == pytest.approx(_itl(si), abs=1e-12)  # dt vs a difference of clocks
    for a, b in ((si.scheduler, ji.scheduler),):
        assert (a.num_preemptions, a.num_swaps, a.prefix_cache_hits, a.prefix_cache_queries) == \
            (b.num_preemptions, b.num_swaps, b.prefix_cache_hits, b.prefix_cache_queries)
        ka, kb = a.kv_cache_manager, b.kv_cache_manager
        assert set(ka.pool.cached_block_hash_to_block) == set(kb.pool.cached_block_hash_to_block)
        assert ka.pool.num_evicted_blocks == kb.pool.num_evicted_blocks
        assert ka.prefix_cache_stats == kb.prefix_cache_stats
        b.check_invariants()
        assert kb.num_free_blocks == kb.num_usable_blocks
    no_cross = simulate(trace, SimConfig(**{**base, **settings}), FunctionLatency(step_time),
                        cross_arrivals=False)
    assert [dataclasses.asdict(r) for r in no_cross.records] == \
        [dataclasses.asdict(r) for r in stepped.records]
    if settings["max_num_seqs"] == 3:  # sequence-bound: jumps run past arrivals
        assert ji.stats.num_jumps < no_cross.instances[0].stats.num_jumps
    if si.store is not None:
        assert [t.to_dict() for t in si.store.tiers] == [t.to_dict() for t in ji.store.tiers]
        assert [list(t.blocks) for t in si.store.tiers] == [list(t.blocks) for t in ji.store.tiers]
        assert si.store.tiers[0].hits > 0 and si.store.tiers[0].evicted > 0
