"""The router in prefill/decode mode (in-process) in front of a real producer and a real consumer
(each behind a loopback server): `n` > 1 with a seed, beam search, logprobs and a streamed chat
with usage answer as one instance; a producer slower than `--pd-prefill-timeout`, or gone,
falls back to a normal decode in bounded time with the same tokens, and leaves no block or
handoff behind on either side."""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from pagedkv.router.app import create_router_app
from pagedkv.router.pd import PDMode, pd_backends
from pagedkv.router.policies import make_policy
from pagedkv.router.router import Router
from tests.pd.conftest import BLOCK_SIZE, assert_same_answer, cached, pd_engines, served

PREFILL_TIMEOUT_S = 2.0
pytestmark = pytest.mark.timeout(120, method="thread")


@contextlib.contextmanager
def router_for(prefill_url: str, decode_url: str):
    router = Router(pd_backends([prefill_url], [decode_url]), make_policy("round-robin"))
    pd = PDMode(router, prefill_timeout_s=PREFILL_TIMEOUT_S)
    with TestClient(create_router_app(router, health_interval_s=60, pd=pd)) as client:
        yield client


@pytest.fixture(scope="module")
def fleet(tiny_llama, tmp_path_factory):
    with pd_engines(tiny_llama, "push", tmp_path_factory.mktemp("pd")) as engines, \
            served(engines[0]) as prefill_url, served(engines[1]) as decode_url, \
            router_for(prefill_url, decode_url) as client, \
            httpx.Client(base_url=decode_url, timeout=60) as alone:
        yield engines, client, alone


def prompt_of(seed: int, length: int = 30) -> list[int]:
    return [7 + (seed * 23 + i * 31) % 180 for i in range(length)]


def one_instance(alone: httpx.Client, request: dict) -> dict:
    """The request on an engine that serves it whole (the consumer, under a salt of its own)."""
    answer = alone.post("/v1/chat/completions" if "messages" in request else "/v1/completions",
                        json={**request, "cache_salt": f"alone-{time.monotonic_ns()}"})
    assert answer.status_code == 200, answer.text
    return answer.json()


def routed(client: TestClient, request: dict) -> dict:
    answer = client.post("/v1/completions", json=request)
    assert answer.status_code == 200, answer.text
    return answer.json()


def assert_idle(engines) -> None:
    """No request, block or handoff left on either engine (checked from outside its loop, once
    it is idle)."""
    for engine in engines:
        kv = engine.scheduler.kv_cache_manager
        deadline = time.monotonic() + 10
        while kv.pool.get_num_free_blocks() != kv.num_usable_blocks:
            assert time.monotonic() < deadline, "blocks not given back"
            time.sleep(0.02)
    assert engines[0].core.kv_transfer.num_jobs == 0


@pytest.mark.parametrize("extra", [
    {"n": 2, "temperature": 0.8, "seed": 99}, {"n": 2, "use_beam_search": True},
    {"logprobs": 2}])
def test_sampling_shapes_through_the_router_equal_one_instance(fleet, extra):
    engines, client, alone = fleet
    request = {"model": "m", "prompt": prompt_of(len(str(extra))), "max_tokens": 5,
               "temperature": 0.0, "ignore_eos": True, **extra}
    got = routed(client, request)
    assert cached(got) == 7 * BLOCK_SIZE  # the decode loaded the producer's blocks
    want = one_instance(alone, request)
    if extra.get("logprobs"):
        assert_same_answer(got, want)
    else:
        assert sorted(c["text"] for c in got["choices"]) == \
            sorted(c["text"] for c in want["choices"])
    assert_idle(engines)


def test_a_streamed_chat_with_usage_through_the_router(fleet):
    engines, client, alone = fleet
    request = {"model": "m", "messages": [{"role": "user", "content": "route me " * 8}],
               "max_tokens": 4, "temperature": 0.0, "stream": True,
               "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=request) as resp:
        assert resp.status_code == 200
        chunks = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and cached(chunks[-1]) > 0
    want = one_instance(alone, {**request, "stream": False, "stream_options": None})
    assert text == want["choices"][0]["message"]["content"]
    assert_idle(engines)


def test_a_slow_producer_falls_back_in_bounded_time(fleet, monkeypatch):
    engines, client, alone = fleet
    sender = engines[0].core.kv_transfer.sender
    real_push = sender.push

    def slow_push(*args, **kwargs):
        time.sleep(PREFILL_TIMEOUT_S + 0.5)
        return real_push(*args, **kwargs)

    monkeypatch.setattr(sender, "push", slow_push)
    request = {"model": "m", "prompt": prompt_of(50), "max_tokens": 5, "temperature": 0.0,
               "ignore_eos": True, "logprobs": 1}
    start = time.monotonic()
    got = routed(client, request)
    assert time.monotonic() - start < PREFILL_TIMEOUT_S + 5.0
    assert cached(got) == 0  # computed on the decode instance
    assert_same_answer(got, one_instance(alone, request))
    metrics = client.get("/metrics").text
    assert 'pagedkv_router:pd_fallbacks_total{reason="timeout"} 1.0' in metrics
    time.sleep(1.0)  # the producer's handoff ends and is answered to nobody
    assert_idle(engines)
