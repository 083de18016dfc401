"""A ZMQ subscriber decodes the engine's published KV events, and they match the pool."""

from __future__ import annotations

import json
import random
import time

import pytest
import zmq

from pagedkv import LLM, SamplingParams
from pagedkv.events.config import parse_kv_events_config
from pagedkv.events.publisher import to_wire_events
from pagedkv.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    decode_seq,
)
from pagedkv.kv.hashing import get_hash_fn, hash_block_tokens, request_extra_keys
from pagedkv.kv.manager import KVCacheManager
from tests.kv.conftest import make_request, prefill


def _subscribe(endpoint: str, topic: bytes) -> tuple[zmq.Context, zmq.Socket]:
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    time.sleep(0.5)  # PUB/SUB slow joiner: let the subscription reach the publisher
    return context, sub


def _drain(sub: zmq.Socket, idle_s: float = 1.0) -> list[list[bytes]]:
    frames = []
    while sub.poll(int(idle_s * 1000)):
        frames.append(sub.recv_multipart())
    return frames


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "int8"])
def test_subscriber_index_matches_the_pool(tiny_llama, kv_cache_dtype):
    """With every cache format (a block's hash names its tokens, never its bytes) the
    subscriber's index of the published events is the pool's cached blocks."""
    block_size = 4
    llm = LLM(model=str(tiny_llama), seed=0, block_size=block_size, num_gpu_blocks_override=24,
              max_num_seqs=4, kv_cache_dtype=kv_cache_dtype, kv_events_config=json.dumps(
                  {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
                   "topic": "kv@test"}))
    engine = llm.llm_engine
    context, sub = _subscribe(engine.event_publisher.endpoint, b"kv@test")
    try:
        rng = random.Random(1)
        prefix = [rng.randrange(4, 200) for _ in range(12)]
        prompts = [prefix + [rng.randrange(4, 200) for _ in range(rng.randint(3, 20))]
                   for _ in range(10)]
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)
        frames = _drain(sub)
    finally:
        sub.close(0)
        context.term()
    pool = engine.scheduler.kv_cache_manager.pool
    pool.check_invariants()

    assert frames, "no event batches received"
    seqs = [decode_seq(f[1]) for f in frames]
    assert seqs == list(range(len(seqs)))
    assert all(f[0] == b"kv@test" for f in frames)
    hash_fn = get_hash_fn("sha256")
    index: set[bytes] = set()
    num_removed = 0
    for frame in frames:
        for event in decode_batch(frame[2]).events:
            if isinstance(event, BlockStored):
                assert event.medium == "GPU" and event.block_size == block_size
                # vLLM 0.32 names the group and its kind even for a single-group cache
                assert (event.group_idx, event.kv_cache_spec_kind,
                        event.kv_cache_spec_sliding_window) == (0, "full_attention", None)
                parent = event.parent_block_hash
                for i, block_hash in enumerate(event.block_hashes):
                    tokens = event.token_ids[i * block_size:(i + 1) * block_size]
                    expected = hash_block_tokens(hash_fn, parent, tokens,
                                                 request_extra_keys(None, None, parent is None))
                    assert block_hash == expected  # raw chained-hash bytes, tokens in order
                    assert block_hash not in index
                    index.add(block_hash)
                    parent = block_hash
            elif isinstance(event, BlockRemoved):
                assert event.medium == "GPU" and event.group_idx == 0
                for block_hash in event.block_hashes:
                    index.remove(block_hash)
                    num_removed += 1
            else:
                assert isinstance(event, AllBlocksCleared)
                index.clear()
    assert num_removed > 0, "the pool was meant to be small enough to evict"
    assert index == set(pool.cached_block_hash_to_block)


def test_sliding_window_cache_events_name_the_window():
    """A single-group cache whose every layer slides: its stored blocks' wire events say
    `sliding_window` and the window, as vLLM's SlidingWindowSpec group does."""
    manager = KVCacheManager(num_blocks=17, block_size=4, watermark=0.0, sliding_window=8,
                             enable_kv_cache_events=True)
    request = make_request("r", range(12))
    prefill(manager, request)
    manager.check_invariants()
    events = to_wire_events(manager.take_events())
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored and all((e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
                          == (0, "sliding_window", 8) for e in stored)
    manager.free(request)
    manager.check_invariants()


def test_reset_publishes_all_blocks_cleared(tiny_llama):
    llm = LLM(model=str(tiny_llama), seed=0, block_size=4, kv_events_config={
        "enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*"})
    engine = llm.llm_engine
    context, sub = _subscribe(engine.event_publisher.endpoint, b"")
    try:
        llm.generate([{"prompt_token_ids": list(range(10, 30))}],
                     SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
        assert engine.scheduler.kv_cache_manager.reset_prefix_cache()
        engine.step()
        frames = _drain(sub)
    finally:
        sub.close(0)
        context.term()
    events = [e for f in frames for e in decode_batch(f[2]).events]
    assert isinstance(events[0], BlockStored)
    assert isinstance(events[-1], AllBlocksCleared)


def test_empty_salt_is_no_salt_as_in_vllm(tiny_llama):
    """An empty `cache_salt` through the Python API (the HTTP API refuses it) is no salt, as
    vLLM's `generate_block_hash_extra_keys` has it: `None` in the events' `extra_keys`, the
    unsalted hashes, so an unsalted request hits its blocks; a real salt still separates."""
    llm = LLM(model=str(tiny_llama), seed=0, block_size=4, kv_events_config={
        "enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*"})
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": list(range(10, 22))}
    params = SamplingParams(max_tokens=1, temperature=0.0)
    context, sub = _subscribe(engine.event_publisher.endpoint, b"")
    cached = {}
    try:
        for request_id, salt in (("empty", ""), ("none", None), ("salted", "tenant")):
            engine.add_request(request_id, prompt, params, cache_salt=salt)
            while engine.has_unfinished_requests():
                for output in engine.step():
                    cached[output.request_id] = output.num_cached_tokens
        frames = _drain(sub)
    finally:
        sub.close(0)
        context.term()
    engine.scheduler.kv_cache_manager.pool.check_invariants()
    stored = [e for f in frames for e in decode_batch(f[2]).events if isinstance(e, BlockStored)]
    first, salted = stored[0], stored[-1]
    assert len(first.block_hashes) == 3 and first.extra_keys == [None] * 3  # the 3 full blocks
    expected = hash_block_tokens(get_hash_fn("sha256"), None, prompt["prompt_token_ids"][:4],
                                 request_extra_keys(None, None, True))
    assert first.block_hashes[0] == expected  # the unsalted hash
    assert cached == {"empty": 0, "none": 8, "salted": 0}
    assert salted.extra_keys == [("tenant",), None, None]


@pytest.mark.parametrize("bad", ['{"enable_kv_cache_events": true, "publisher": "kafka"}',
                                 '{"nope": 1}', "not json", '{"enable_kv_cache_events": "yes"}'])
def test_bad_config_is_a_value_error(bad):
    with pytest.raises(ValueError, match="kv_events_config"):
        parse_kv_events_config(bad)


def test_disabled_by_default(tiny_llama):
    llm = LLM(model=str(tiny_llama), seed=0, block_size=4)
    assert llm.llm_engine.event_publisher is None
    assert not llm.llm_engine.scheduler.kv_cache_manager.pool.enable_kv_cache_events


def test_tier_events_carry_their_medium(tiny_llama):
    """With a host tier too small for the workload, the subscriber's CPU index matches it."""
    llm = LLM(model=str(tiny_llama), seed=0, block_size=4, num_gpu_blocks_override=20,
              max_num_seqs=1, kv_offloading_size=0.00005, kv_events_config={
                  "enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*"})
    engine = llm.llm_engine
    store = engine.kv_store
    context, sub = _subscribe(engine.event_publisher.endpoint, b"")
    try:
        rng = random.Random(2)
        for _ in range(4):
            prompt = [rng.randrange(4, 200) for _ in range(45)]
            llm.generate([{"prompt_token_ids": prompt}],
                         SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
            store.flush()
        engine.step()  # publishes the last saves' events
        frames = _drain(sub)
    finally:
        sub.close(0)
        context.term()
    host = store.tiers[0]
    cpu_index: set[bytes] = set()
    num_removed = 0
    for frame in frames:
        for event in decode_batch(frame[2]).events:
            if event.medium != "CPU":
                continue
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == 4 * len(event.block_hashes)
                cpu_index.update(event.block_hashes)
            else:
                cpu_index.difference_update(event.block_hashes)
                num_removed += len(event.block_hashes)
    held = {key[len(store.identity):] for key in host.stored_keys()}
    assert num_removed > 0
    assert cpu_index == held
    engine.check_invariants()
