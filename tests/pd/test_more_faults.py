"""Faults of prefill/decode disaggregation beyond test_faults.py, each ending in bounded time with
the one-instance answer or a clear 400, and every block back on both sides: forged counts and
types, params replayed after their blocks were taken or expired, a consumer restarted between
the answer and the load, a Redis tier that vanishes mid-transfer, a client that leaves during
the decode, and a handoff the server gave up on (its job forgotten, not kept forever)."""

from __future__ import annotations

import logging
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.server.app import create_app
from pagedkv.store.redis_server import RedisServer
from tests.pd.conftest import (
    BLOCK_SIZE,
    TRANSFER_TIMEOUT_S,
    Pair,
    assert_blocks_back,
    assert_same_answer,
    body,
    cached,
    one_instance,
    pd_engines,
    pd_pair,
    post,
    prefill,
    served,
    utility,
)
from tests.server.helpers import scrape

BOUND_S = TRANSFER_TIMEOUT_S + 5.0


def prompt_of(seed: int, length: int = 33) -> list[int]:
    return [4 + (seed * 41 + i * 19) % 190 for i in range(length)]


@pytest.fixture(scope="module")
def pair(tiny_llama, tmp_path_factory):
    with pd_pair(tiny_llama, "push", tmp_path_factory.mktemp("pd")) as made:
        yield made


def timed(pair, request: dict, params: dict, bound: float = BOUND_S) -> dict:
    start = time.monotonic()
    answer = post(pair.b, request, params)
    assert time.monotonic() - start < bound
    return answer


FORGED = [
    {"num_blocks": 10**12}, {"num_blocks": 9}, {"tp_size": -1}, {"block_size": -4},
    {"block_size": 0}, {"num_tokens": 10**15}, {"block_hashes": ["00" * 32] * 20000},
    {"block_hashes": ["not hex"]}, {"cache_salt": ""}, {"transport": None}]


@pytest.mark.parametrize("forged", FORGED)
def test_forged_counts_are_refused_at_once_and_recomputed(pair, caplog, forged):
    """Params of the right shape that cannot be true: refused without waiting for blocks (what
    did arrive intact under this engine's own keys may still be loaded: it is the prompt's)."""
    request = body(prompt_of(100 + FORGED.index(forged)))
    params = {**prefill(pair.a, request)["kv_transfer_params"], **forged}
    with caplog.at_level(logging.WARNING, logger="pagedkv.server"):
        decoded = timed(pair, request, params, bound=TRANSFER_TIMEOUT_S)
    assert "do not fit this request" in caplog.text
    assert_same_answer(decoded, one_instance(pair, request))
    assert_blocks_back(pair)


@pytest.mark.parametrize("params", [
    {"do_remote_prefill": True, "num_blocks": -1}, {"do_remote_prefill": True, "tp_size": "2"},
    {"do_remote_prefill": True, "block_hashes": [1, 2]},
    {"do_remote_prefill": True, "remote_port": 70000},
    {"do_remote_prefill": True, "block_size": 4.5}, {"do_remote_prefill": None},
    {"do_remote_decode": True, "remote_port": -1}])
def test_params_of_the_wrong_type_or_sign_are_a_400(pair, params):
    answer = pair.b.post("/v1/completions", json={**body(prompt_of(2)),
                                                  "kv_transfer_params": params})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert "kv_transfer_params" in answer.json()["error"]["message"]
    assert_blocks_back(pair)


def test_params_replayed_after_their_blocks_were_loaded(pair):
    """The second load finds the pushed blocks gone (taken by the first load) but the device
    cache holding them: it waits for nothing and loads them from there."""
    request = body(prompt_of(3))
    params = prefill(pair.a, request)["kv_transfer_params"]
    first = timed(pair, request, params)
    assert cached(first) == 8 * BLOCK_SIZE
    second = timed(pair, request, params, bound=TRANSFER_TIMEOUT_S)
    assert cached(second) == 8 * BLOCK_SIZE
    assert_same_answer(second, first)
    assert_blocks_back(pair)


def test_a_push_held_past_hold_s_is_dropped_and_recomputed(pair, monkeypatch):
    request = body(prompt_of(4))
    params = prefill(pair.a, request)["kv_transfer_params"]
    receiver = pair.consumer.core.kv_transfer.receiver
    deadline = time.monotonic() + BOUND_S
    while receiver.num_blocks < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    monkeypatch.setattr(receiver, "hold_s", 1e-6)  # every held block is now past its time
    decoded = timed(pair, request, params)
    assert cached(decoded) == 0 and receiver.num_blocks == 0
    assert_same_answer(decoded, one_instance(pair, request))
    assert_blocks_back(pair)


def test_a_handoff_the_server_gave_up_on_is_forgotten(pair, monkeypatch):
    """A push slower than the server's wait: the answer comes without blocks, and neither the
    core nor the rank keeps the job."""
    from pagedkv.server import kv_transfer as server_side

    sender = pair.producer.core.kv_transfer.sender
    real_push = sender.push

    def slow_push(*args, **kwargs):
        time.sleep(1.0)
        return real_push(*args, **kwargs)

    monkeypatch.setattr(sender, "push", slow_push)
    monkeypatch.setattr(server_side, "HANDOFF_MARGIN_S", 0.3 - TRANSFER_TIMEOUT_S)
    request = body(prompt_of(5))
    params = prefill(pair.a, request)["kv_transfer_params"]
    assert params["num_tokens"] == 0 and params["block_hashes"] == []
    assert utility(pair.a, "kv_transfer.stats")["jobs_pending"] == 0
    assert pair.producer.core.kv_transfer.local.num_jobs == 0
    time.sleep(1.2)  # the rank's push, forgotten, still ends in bounded time
    decoded = timed(pair, request, params)
    assert_same_answer(decoded, one_instance(pair, request))
    assert_blocks_back(pair)


def test_handoff_jobs_nobody_polls_are_forgotten(pair, monkeypatch):
    """A server task cancelled while it waited leaves its job unpolled: the next handoff
    forgets every job older than JOB_TTL_S, on the core and on the rank."""
    from pagedkv.store import transfer

    prompt = prompt_of(12)
    for _ in range(3):
        utility(pair.a, "kv_transfer.start_handoff", prompt, None, None, None)
    assert utility(pair.a, "kv_transfer.stats")["jobs_pending"] == 3
    monkeypatch.setattr(transfer, "JOB_TTL_S", 0.0)
    job = utility(pair.a, "kv_transfer.start_handoff", prompt, None, None, None)
    assert utility(pair.a, "kv_transfer.stats")["jobs_pending"] == 1
    deadline = time.monotonic() + BOUND_S
    while utility(pair.a, "kv_transfer.poll_handoff", job) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert utility(pair.a, "kv_transfer.stats")["jobs_pending"] == 0
    assert pair.producer.core.kv_transfer.local.num_jobs == 0
    assert_blocks_back(pair)


def test_a_client_that_leaves_during_the_decode_frees_both_sides(tiny_llama, tmp_path):
    with pd_engines(tiny_llama, "push", tmp_path) as (producer, consumer), \
            TestClient(create_app(producer, served_model_name="m")) as a:
        request = body(prompt_of(6), max_tokens=200, logprobs=None, stream=True)
        params = prefill(a, {**request, "stream": False})["kv_transfer_params"]
        with served(consumer) as url:
            with httpx.stream("POST", url + "/v1/completions", timeout=30,
                              json={**request, "kv_transfer_params": params}) as resp:
                lines = resp.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
            deadline = time.monotonic() + BOUND_S
            kv = consumer.scheduler.kv_cache_manager
            while kv.pool.get_num_free_blocks() < kv.num_usable_blocks:
                assert time.monotonic() < deadline, "the decode kept its blocks"
                time.sleep(0.02)
            assert scrape(url)["pagedkv:num_requests_running"] == 0
        assert consumer.core.kv_transfer.receiver.num_blocks == 0  # loaded, not kept
        utility(a, "check_invariants")
        kv = producer.scheduler.kv_cache_manager
        assert kv.pool.get_num_free_blocks() == kv.num_usable_blocks


def test_a_consumer_restarted_between_answer_and_load(tiny_llama, tmp_path):
    """Store: the blocks wait in the shared tier for the new consumer. Push: they went to the
    old one; the new one computes the prompt in bounded time."""
    for connector in ("store", "push"):
        with pd_engines(tiny_llama, connector, tmp_path / connector) as (producer, old), \
                TestClient(create_app(producer, served_model_name="m")) as a:
            request = body(prompt_of(7))
            params = prefill(a, request)["kv_transfer_params"]
            old.shutdown()
            consumer = LLMEngine(old.args)  # the same flags: the same kv_port, the same tier
            try:
                with TestClient(create_app(consumer, served_model_name="m")) as b:
                    made = Pair(producer, consumer, a, b, connector)
                    decoded = timed(made, request, params)
                    assert cached(decoded) == (8 * BLOCK_SIZE if connector == "store" else 0)
                    assert_same_answer(decoded, one_instance(made, request))
                    assert_blocks_back(made)
            finally:
                consumer.shutdown()


def test_a_redis_tier_that_vanishes_mid_transfer(tiny_llama, tmp_path):
    """Redis goes between the producer's answer and the consumer's load, and is down for the
    next prefill: each request answered in bounded time with one instance's tokens."""
    with RedisServer(maxmemory="64mb") as redis, \
            pd_pair(tiny_llama, "store", tmp_path, redis_url=redis.url) as made:
        request = body(prompt_of(8))
        params = prefill(made.a, request)["kv_transfer_params"]
        assert params["num_tokens"] == 8 * BLOCK_SIZE
        redis.stop()
        decoded = timed(made, request, params)
        assert_same_answer(decoded, one_instance(made, request))
        later = body(prompt_of(9))
        start = time.monotonic()
        params = prefill(made.a, later)["kv_transfer_params"]
        assert time.monotonic() - start < BOUND_S + 2 * TRANSFER_TIMEOUT_S
        decoded = timed(made, later, params)
        assert cached(decoded) == 0
        assert_same_answer(decoded, one_instance(made, later))
        assert_blocks_back(made)
