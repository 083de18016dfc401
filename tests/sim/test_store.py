"""The KV store's tiers in the simulator: the same hits per tier, misses and writes as the real
engine's tiered store (host RAM + disk) on a workload whose device cache evicts, and the
load time on the virtual clock."""

from __future__ import annotations

import argparse
import dataclasses
import random

import pytest

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.kv.hf_spec import kv_cache_spec_from_hf_config
from pagedkv.kv.sizes import GiB
from pagedkv.model.config_files import load_hf_config
from pagedkv.sched.sampling_params import SamplingParams
from pagedkv.sim.config import SimConfig
from pagedkv.sim.latency import LinearLatency
from pagedkv.sim.results import summarize
from pagedkv.sim.setup import parse_tier_speeds, store_tiers
from pagedkv.sim.simulator import simulate
from pagedkv.sim.store import TierSpec
from pagedkv.sim.traces import TraceRequest, prompt_token_ids
from tests.sim.workloads import shared_prefix_trace

BLOCK = 4
HOST_BLOCKS = 30  # more than the device's 23: the host tier holds what the device evicted
DISK_BLOCKS = 80


def documents_trace(num: int = 36, seed: int = 0) -> list[TraceRequest]:
    """Requests one at a time, each on one of 8 shared 16-token documents plus its own
    question: reuse distances from device hits through host hits to disk hits."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        doc = rng.randrange(8)
        out.append(TraceRequest(arrival=100.0 * i, input_length=16 + rng.randrange(1, 7),
                                output_length=rng.randrange(2, 7),
                                block_ids=(10 * doc + 1, 10 * doc + 2, 1000 + i),
                                block_tokens=8))
    return out


def run_one_at_a_time(engine: LLMEngine, trace) -> list[int]:
    """Each request alone, its saves written before the next (cached tokens per request)."""
    store = engine.kv_store
    cached = []
    for i, r in enumerate(trace):
        engine.add_request(str(i), prompt_token_ids(r, engine.vocab_size, i),
                           SamplingParams(max_tokens=r.output_length, ignore_eos=True))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    cached.append(out.num_cached_tokens)
            store.flush()
            engine.check_invariants()
    return cached


def test_store_tier_hits_match_the_engine(tiny_llama, tmp_path):
    trace = documents_trace()
    block_bytes = kv_cache_spec_from_hf_config(load_hf_config(str(tiny_llama)), BLOCK,
                                               "float32").page_size_bytes
    flags = argparse.Namespace(
        kv_offloading_size=HOST_BLOCKS * block_bytes / GiB,
        kv_offloading_disk_path=str(tmp_path / "disk"),
        kv_offloading_disk_size=(DISK_BLOCKS * (block_bytes + 200) + 100) / GiB,
        kv_offloading_remote_url=None, prefix_caching_hash_algo="sha256", tier_speeds=None)
    engine = LLMEngine(EngineArgs(
        model=str(tiny_llama), device="cpu", block_size=BLOCK, num_gpu_blocks_override=24,
        cpu_kernels="off", max_model_len=256, kv_offloading_size=flags.kv_offloading_size,
        kv_offloading_disk_path=flags.kv_offloading_disk_path,
        kv_offloading_disk_size=flags.kv_offloading_disk_size))
    real_cached = run_one_at_a_time(engine, trace)
    real = {s.name: s for s in engine.kv_store.snapshot_stats()}
    real_device_hits = engine.scheduler.prefix_cache_hits
    tiers = store_tiers(flags, block_bytes)
    assert [t.name for t in tiers] == ["host", "disk"]
    assert tiers[0].capacity_blocks == engine.kv_store.tiers[0].capacity_blocks(block_bytes)
    engine.shutdown()

    config = SimConfig(num_blocks=24, block_size=BLOCK, max_model_len=256,
                       vocab_size=engine.vocab_size, prefix_caching_hash_algo="sha256",
                       store_tiers=tiers, block_bytes=block_bytes)
    result = simulate(trace, config, LinearLatency())
    inst = result.instances[0]
    sim = {t.spec.name: t for t in inst.store.tiers}
    assert real["host"].hits > 0 and real["disk"].hits > 0  # the workload reaches both tiers
    assert real["host"].blocks_written > HOST_BLOCKS  # and the host tier evicts
    for name in ("host", "disk"):
        assert (sim[name].hits, sim[name].misses, sim[name].blocks_written) == \
            (real[name].hits, real[name].misses, real[name].blocks_written), name
    assert [r.cached_tokens for r in result.records] == real_cached
    assert inst.scheduler.prefix_cache_hits == real_device_hits
    assert inst.store.num_loaded_tokens == sum(real[n].hits for n in real) * BLOCK
    assert result.records and all(r.status == "length" for r in result.records)
    inst.scheduler.check_invariants()
    assert inst.kv.num_free_blocks == inst.kv.num_usable_blocks


def test_load_time_on_the_virtual_clock():
    """A request whose prefix only the store holds (the device cache evicted it) waits for its
    load (latency + bytes over bandwidth) before it runs; a faster tier starts it sooner."""
    base = shared_prefix_trace(num=1, block_tokens=8)[0]
    trace = [dataclasses.replace(base, arrival=10.0 * i, block_ids=ids, input_length=20,
                                 output_length=3)
             for i, ids in enumerate(((1, 2, 3), (7, 8, 9), (1, 2, 3)))]

    def wait_of_the_third(bandwidth: float) -> tuple[float, int]:
        config = SimConfig(num_blocks=7, block_size=BLOCK, max_model_len=64,
                           store_tiers=(TierSpec("host", 100, bandwidth, 1e-3),),
                           block_bytes=1 << 20)
        result = simulate(trace, config, LinearLatency())
        inst = result.instances[0]
        assert inst.scheduler.prefix_cache_hits == 0  # the device cache had evicted it
        inst.scheduler.check_invariants()
        record = result.records[2]
        return record.first_scheduled - record.arrival, inst.store.tiers[0].hits

    (slow, hits), (fast, _) = wait_of_the_third(1e9), wait_of_the_third(1e12)
    assert hits == 4  # 4 full blocks before the last prompt token
    assert slow == pytest.approx(1e-3 + 4 * (1 << 20) / 1e9)
    assert fast == pytest.approx(1e-3 + 4 * (1 << 20) / 1e12)


def test_tier_flags_are_checked():
    assert parse_tier_speeds("host=5e9")["host"] == (5e9, 2e-5)
    with pytest.raises(ValueError, match="'ssd'"):
        parse_tier_speeds("ssd=1e9")
    with pytest.raises(ValueError, match="'host=fast'"):
        parse_tier_speeds("host=fast")
    with pytest.raises(ValueError, match="bandwidth"):
        TierSpec("host", 4, 0.0)
    with pytest.raises(ValueError, match="holds no block"):
        TierSpec("host", 0, 1e9)


def test_redis_tier_is_shared_by_the_instances():
    """Behind a round-robin router the second request runs on the other instance and still
    loads the shared prefix from the Redis tier the first one wrote; host tiers are each
    instance's own."""
    base = shared_prefix_trace(num=1, block_tokens=8)[0]
    trace = [dataclasses.replace(base, arrival=10.0 * i, block_ids=(1, 2, 3), input_length=20,
                                 output_length=3) for i in range(2)]
    flags = argparse.Namespace(kv_offloading_size=4 * (1 << 20) / GiB,
                               kv_offloading_disk_path=None, kv_offloading_remote_url="redis://x",
                               kv_offloading_remote_size=None, prefix_caching_hash_algo="sha256",
                               tier_speeds=None)
    tiers = store_tiers(flags, 1 << 20)
    assert [(t.name, t.capacity_blocks, t.shared) for t in tiers] == \
        [("host", 4, False), ("redis", None, True)]
    config = SimConfig(num_blocks=32, block_size=BLOCK, max_model_len=64, store_tiers=tiers,
                       block_bytes=1 << 20)
    result = simulate(trace, config, LinearLatency(), num_instances=2, policy="round-robin")
    first, second = result.instances
    assert [r.instance for r in result.records] == [0, 1]
    assert first.store.tiers[1] is second.store.tiers[1]
    assert first.store.tiers[0] is not second.store.tiers[0]
    assert (second.store.tiers[0].hits, second.store.tiers[1].hits) == (0, 4)
    assert result.records[1].cached_tokens == 16
    summary = summarize(result)
    assert summary["prefix_cache"]["redis"]["hit_blocks"] == 4  # counted once
    for inst in result.instances:
        inst.scheduler.check_invariants()
