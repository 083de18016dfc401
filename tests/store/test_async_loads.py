"""Asynchronous store loads: the scheduler only looks up (once per admission), loads run on the
store's loader threads while the engine goes on, and a load that fails or times out costs the
recompute of its blocks, never a wrong token, a leaked block or a prefix-cache hit on a block
whose bytes never arrived. Latency and failures are injected around a real tier (SlowTier)."""

from __future__ import annotations

import time

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.sched.request import Request
from tests.engine.conftest import hf_greedy
from tests.store.conftest import (
    BLOCK_SIZE,
    PREFIX_LEN,
    make_prefixes,
    run_one,
    slow_down,
    store_llm,
    two_rounds,
    with_suffix,
)

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def _assert_no_leaks(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.check_invariants()
    kv = engine.scheduler.kv_cache_manager
    assert not engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_usable_blocks  # every block came back


def _stored_then_evicted(llm: LLM, seed: int) -> list[int]:
    """A prefix run once (so the store holds it), then dropped from the device's prefix cache:
    returns the prefix."""
    prefix = make_prefixes(seed=seed, num=1)[0]
    run_one(llm, with_suffix(prefix, seed=1))
    assert llm.llm_engine.scheduler.kv_cache_manager.reset_prefix_cache()
    return prefix


def _block_hashes(llm: LLM, prompt: list[int]) -> list[bytes]:
    hasher = llm.llm_engine.scheduler.kv_cache_manager.hasher
    return hasher(Request("hashes", prompt, SamplingParams()), [])


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_tokens_identical_with_slow_tiers(tiny_llama, tmp_path, tier):
    llm = store_llm(tiny_llama, tier, tmp_path)
    slow = slow_down(llm, lookup_delay_s=0.01, load_delay_s=0.1)
    prefixes = make_prefixes(seed=21, num=3)
    two_rounds(llm, tiny_llama, prefixes)
    assert slow.num_loads == 3
    # Batched: requests load while others compute.
    prompts = [with_suffix(p, seed=99) for p in prefixes]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy(tiny_llama, prompt, 4)
    connector = llm.llm_engine.scheduler.kv_connector
    assert connector.num_failed_load_tokens == 0 and connector.num_pending_loads == 0
    _assert_no_leaks(llm)


def test_disk_file_corrupted_after_lookup_recomputes_the_rest(tiny_llama, tmp_path):
    """Block 6's file is damaged after the lookup said it was there: the load stops at block 6,
    the request computes from there (in 8-token chunks), and at no step does the prefix cache
    hold a block of the request that is neither loaded intact nor computed."""
    prompt = with_suffix(make_prefixes(seed=22, num=1)[0], seed=1)
    run_one(store_llm(tiny_llama, "disk", tmp_path), prompt)
    llm = store_llm(tiny_llama, "disk", tmp_path, max_num_batched_tokens=8)
    engine = llm.llm_engine
    store = engine.kv_store
    hashes = _block_hashes(llm, prompt)
    damaged = store.tiers[0].path(store.key(hashes[6]))

    def corrupt() -> None:
        data = bytearray(damaged.read_bytes())
        data[len(data) // 2] ^= 0x40
        damaged.write_bytes(bytes(data))

    slow = slow_down(llm, before_load=corrupt)
    engine.add_request("r", {"prompt_token_ids": prompt}, GREEDY)
    pool = engine.scheduler.kv_cache_manager.pool
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
        request = engine.scheduler.requests.get("r")
        if request is not None:
            num_computed_blocks = request.num_computed_tokens // BLOCK_SIZE
            cached = [i for i, h in enumerate(hashes) if h in pool.cached_block_hash_to_block]
            assert all(i < num_computed_blocks for i in cached), (cached, num_computed_blocks)
        engine.check_invariants()
    assert slow.num_loads == 1
    assert final.num_cached_tokens == 6 * BLOCK_SIZE
    assert list(final.outputs[0].token_ids) == hf_greedy(tiny_llama, prompt, 4)
    assert engine.scheduler.kv_connector.num_failed_load_tokens == (11 - 6) * BLOCK_SIZE
    assert store.tiers[0].inner.num_corrupt == 1
    _assert_no_leaks(llm)


def test_redis_killed_between_lookup_and_load(tiny_llama, tmp_path, redis_server):
    llm = store_llm(tiny_llama, "redis", tmp_path, redis_server.url)
    prefix = _stored_then_evicted(llm, seed=23)
    slow_down(llm, before_load=redis_server.stop)
    prompt = with_suffix(prefix, seed=2)
    tokens, cached = run_one(llm, prompt)
    assert cached == 0  # the lookup found ten blocks; none arrived
    assert tokens == hf_greedy(tiny_llama, prompt, 4)
    assert llm.llm_engine.scheduler.kv_connector.num_failed_load_tokens == PREFIX_LEN
    _assert_no_leaks(llm)


def test_a_load_that_times_out_is_recomputed(tiny_llama, tmp_path):
    llm = store_llm(tiny_llama, "host", tmp_path)
    prefix = _stored_then_evicted(llm, seed=24)
    slow_down(llm, load_delay_s=1.0)
    worker = llm.llm_engine.runner.kv_connector
    worker.load_timeout_s = 0.1
    prompt = with_suffix(prefix, seed=2)
    tokens, cached = run_one(llm, prompt)
    assert cached == 0
    assert tokens == hf_greedy(tiny_llama, prompt, 4)
    assert worker.num_failed_loads == 1
    assert llm.llm_engine.scheduler.kv_connector.num_failed_load_tokens == PREFIX_LEN
    _assert_no_leaks(llm)


def test_a_request_aborted_while_loading_frees_its_blocks_untouched(tiny_llama, tmp_path):
    llm = store_llm(tiny_llama, "host", tmp_path)
    engine = llm.llm_engine
    prefix = _stored_then_evicted(llm, seed=25)
    slow = slow_down(llm, load_delay_s=0.3)
    engine.add_request("b", {"prompt_token_ids": with_suffix(prefix, seed=2)}, GREEDY)
    engine.step()  # admitted: its blocks are allocated and its load is running
    (request,) = engine.scheduler.loading
    block_ids = engine.scheduler.kv_cache_manager.get_block_ids("b")
    engine.abort_request("b")
    engine.check_invariants()
    deadline = time.monotonic() + 30
    while slow.num_loads_done == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # the read returned; its copy into host rows is done too
    kv = engine.runner.kv_cache.kv
    before = kv[:, :, :, block_ids].clone()
    engine.step()  # tells the worker about the cancelled load
    assert kv[:, :, :, block_ids].equal(before)  # the finished read was dropped, not copied
    _assert_no_leaks(llm)
    prompt = with_suffix(prefix, seed=3)
    tokens, cached = run_one(llm, prompt)
    assert cached == PREFIX_LEN and tokens == hf_greedy(tiny_llama, prompt, 4)
    _assert_no_leaks(llm)


def test_decodes_go_on_while_another_request_loads(tiny_llama, tmp_path):
    """Request A decodes while B's load (1.5 s of tier latency) is in flight: the engine
    thread never waits on the tier while it has other work."""
    llm = store_llm(tiny_llama, "host", tmp_path, num_gpu_blocks_override=64)
    engine = llm.llm_engine
    prefix = _stored_then_evicted(llm, seed=26)
    a_prompt = make_prefixes(seed=27, num=1, length=6)[0]
    engine.add_request("a", {"prompt_token_ids": a_prompt},
                       SamplingParams(max_tokens=24, temperature=0.0))
    a_tokens: list[int] = []

    def step() -> None:
        for out in engine.step():
            if out.request_id == "a":
                a_tokens[:] = out.outputs[0].token_ids
            else:
                b_final.append(out)

    b_final: list = []
    while not a_tokens:
        step()
    slow_down(llm, load_delay_s=1.5)
    b_prompt = with_suffix(prefix, seed=2)
    engine.add_request("b", {"prompt_token_ids": b_prompt}, GREEDY)
    step()
    assert [r.request_id for r in engine.scheduler.loading] == ["b"]
    a_before = len(a_tokens)
    while engine.scheduler.loading:
        step()
    assert len(a_tokens) - a_before >= 3  # A kept decoding during B's load
    while engine.has_unfinished_requests():
        step()
    assert a_tokens == hf_greedy(tiny_llama, a_prompt, 24)
    final = b_final[-1]
    assert final.num_cached_tokens == PREFIX_LEN
    assert list(final.outputs[0].token_ids) == hf_greedy(tiny_llama, b_prompt, 4)
    _assert_no_leaks(llm)


def test_a_waiting_request_is_looked_up_once(tiny_llama, tmp_path):
    """B waits several steps for blocks (A holds them): the tier is asked about B once."""
    llm = store_llm(tiny_llama, "host", tmp_path)
    engine = llm.llm_engine
    prefix = _stored_then_evicted(llm, seed=28)
    slow = slow_down(llm)
    a_prompt = make_prefixes(seed=29, num=1, length=44)[0]  # 11 of the 19 blocks
    engine.add_request("a", {"prompt_token_ids": a_prompt},
                       SamplingParams(max_tokens=12, temperature=0.0))
    engine.step()
    b_prompt = with_suffix(prefix, seed=2)
    engine.add_request("b", {"prompt_token_ids": b_prompt}, GREEDY)
    steps_waiting = 0
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finals[out.request_id] = out
        steps_waiting += any(r.request_id == "b" for r in engine.scheduler.waiting)
        engine.check_invariants()
    assert steps_waiting >= 3
    assert slow.num_lookups == 2  # once for A, once for B (not once a step)
    assert finals["b"].num_cached_tokens == PREFIX_LEN
    assert list(finals["b"].outputs[0].token_ids) == hf_greedy(tiny_llama, b_prompt, 4)
    assert list(finals["a"].outputs[0].token_ids) == hf_greedy(tiny_llama, a_prompt, 12)
    _assert_no_leaks(llm)


def test_an_idle_step_does_not_wait_out_a_slow_load(tiny_llama, tmp_path):
    """With only a 2 s load in flight, a step waits briefly and returns: a request arriving
    meanwhile is admitted and runs before the load is done."""
    llm = store_llm(tiny_llama, "host", tmp_path)
    engine = llm.llm_engine
    prefix = _stored_then_evicted(llm, seed=30)
    slow = slow_down(llm, load_delay_s=2.0)
    b_prompt = with_suffix(prefix, seed=2)
    engine.add_request("b", {"prompt_token_ids": b_prompt}, GREEDY)
    engine.step()
    engine.step()  # nothing but the load to do
    assert slow.num_loads_done == 0 and [r.request_id for r in engine.scheduler.loading] == ["b"]
    c_prompt = [5, 6, 7]
    engine.add_request("c", {"prompt_token_ids": c_prompt}, GREEDY)
    engine.step()
    assert slow.num_loads_done == 0
    assert [r.request_id for r in engine.scheduler.running] == ["c"]
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finals[out.request_id] = out
    assert list(finals["c"].outputs[0].token_ids) == hf_greedy(tiny_llama, c_prompt, 4)
    assert list(finals["b"].outputs[0].token_ids) == hf_greedy(tiny_llama, b_prompt, 4)
    assert finals["b"].num_cached_tokens == PREFIX_LEN
    _assert_no_leaks(llm)
