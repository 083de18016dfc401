"""Helpers of the prefill/decode disaggregation tests: a producer and a consumer engine (one
process, each behind its own in-process server app), and the requests vLLM's PD proxy sends."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi.testclient import TestClient

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.server.app import create_app
from tests.server.helpers import free_port

TRANSFER_TIMEOUT_S = 1.0  # how long a consumer waits for pushed blocks in these tests
BLOCK_SIZE = 4
# What vLLM's PD proxy adds to the prefill request.
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


@dataclass
class Pair:
    """A producer (`a`) and a consumer (`b`), their engines and servers' clients."""

    producer: LLMEngine
    consumer: LLMEngine
    a: TestClient
    b: TestClient
    connector: str


def engine_args(model_dir: Path, transfer: dict, **extra: Any) -> EngineArgs:
    settings = {"dtype": "float32", "block_size": BLOCK_SIZE, "max_model_len": 256,
                "num_gpu_blocks_override": 96, **extra}
    return EngineArgs(model=str(model_dir), kv_transfer_config=json.dumps(transfer), **settings)


@contextlib.contextmanager
def pd_engines(model_dir: Path, connector: str, tmp: Path, kv_cache_dtype: str = "auto",
               consumer_port: int | None = None, consumer_extra: dict | None = None,
               redis_url: str | None = None) -> Iterator[tuple[LLMEngine, LLMEngine]]:
    """A producer and a consumer engine of `connector` ("store": through a shared disk tier at
    `tmp`, or the Redis at `redis_url`; "push": the producer pushes to the consumer's port, or
    to `consumer_port` when given). `consumer_extra`: the consumer's engine arguments that
    differ from the producer's."""
    extra: dict[str, Any] = {"kv_cache_dtype": kv_cache_dtype}
    timing = {"transfer_timeout_s": TRANSFER_TIMEOUT_S}
    if connector == "store" and redis_url is not None:
        extra.update(kv_offloading_remote_url=redis_url)
    elif connector == "store":
        extra.update(kv_offloading_disk_path=str(tmp / "shared"), kv_offloading_disk_size=0.1)
    if connector == "store":
        name = "PagedKVStoreConnector"
        produce = {"kv_role": "kv_producer", "kv_connector": name,
                   "kv_connector_extra_config": timing}
        consume = {"kv_role": "kv_consumer", "kv_connector": name,
                   "kv_connector_extra_config": timing}
    else:
        name = "PagedKVPushConnector"
        port = free_port()
        target = consumer_port or port
        produce = {"kv_role": "kv_producer", "kv_connector": name, "kv_port": free_port(),
                   "kv_buffer_size": 2**22, "kv_connector_extra_config": {
                       "consumers": [f"127.0.0.1:{target}"], **timing}}
        consume = {"kv_role": "kv_consumer", "kv_connector": name, "kv_port": port,
                   "kv_buffer_size": 2**22, "kv_connector_extra_config": timing}
    producer = LLMEngine(engine_args(model_dir, produce, **extra))
    try:
        consumer = LLMEngine(engine_args(model_dir, consume,
                                         **{**extra, **(consumer_extra or {})}))
    except BaseException:
        producer.shutdown()
        raise
    try:
        yield producer, consumer
    finally:
        producer.shutdown()
        consumer.shutdown()


@contextlib.contextmanager
def pd_pair(model_dir: Path, connector: str, tmp: Path, kv_cache_dtype: str = "auto",
            **more: Any) -> Iterator[Pair]:
    """`pd_engines`, each behind its own in-process server app."""
    with pd_engines(model_dir, connector, tmp, kv_cache_dtype, **more) as (producer, consumer), \
            TestClient(create_app(producer, served_model_name="m")) as a, \
            TestClient(create_app(consumer, served_model_name="m")) as b:
        yield Pair(producer, consumer, a, b, connector)


@contextlib.contextmanager
def served(engine: LLMEngine) -> Iterator[str]:
    """`engine` behind a real HTTP server on a loopback port (its URL): a client can
    disconnect, and a router can reach it."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, served_model_name="m"),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def body(prompt: list[int], max_tokens: int = 6, **more: Any) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "logprobs": 1, "ignore_eos": True, **more}


def prefill(client: TestClient, request: dict) -> dict:
    """The producer's answer to the proxy's prefill request (max_tokens 1, no stream)."""
    sent = {**request, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
    if "messages" in request:
        sent["max_completion_tokens"] = 1
    answer = client.post("/v1/chat/completions" if "messages" in request else "/v1/completions",
                         json=sent)
    assert answer.status_code == 200, answer.text
    return answer.json()


def post(client: TestClient, request: dict, params: dict | None = None) -> dict:
    sent = request if params is None else {**request, "kv_transfer_params": params}
    answer = client.post("/v1/chat/completions" if "messages" in request else "/v1/completions",
                         json=sent)
    assert answer.status_code == 200, answer.text
    return answer.json()


def tokens_and_logprobs(answer: dict) -> tuple[list, list[float]]:
    choice = answer["choices"][0]
    if "message" in choice:
        entries = choice["logprobs"]["content"]
        return [e["token"] for e in entries], [e["logprob"] for e in entries]
    return choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]


def assert_same_answer(got: dict, want: dict) -> None:
    """The same tokens, and logprobs equal within float noise."""
    got_tokens, got_lp = tokens_and_logprobs(got)
    want_tokens, want_lp = tokens_and_logprobs(want)
    assert got_tokens == want_tokens
    assert max(abs(g - w) for g, w in zip(got_lp, want_lp, strict=True)) < 1e-4


def utility(client: TestClient, method: str, *args: Any) -> Any:
    """A core utility call through the server's engine loop (the thread that steps it)."""
    engine = client.app.state.async_engine
    return client.portal.call(lambda: engine.call_utility(method, *args))


def assert_blocks_back(pair: Pair) -> None:
    """Every block of both engines is free again (cached blocks count as free) and the pools'
    invariants hold."""
    for client, engine in ((pair.a, pair.producer), (pair.b, pair.consumer)):
        utility(client, "check_invariants")
        stats = utility(client, "get_stats")
        kv = engine.scheduler.kv_cache_manager
        assert stats.num_running == stats.num_waiting == 0
        assert kv.pool.get_num_free_blocks() == kv.num_usable_blocks


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def one_instance(pair: Pair, request: dict) -> dict:
    """The same request computed whole on one instance: the consumer, under a salt of its
    own, so that no block of any earlier run is reused."""
    answer = post(pair.b, {**request, "cache_salt": f"one-instance-{uuid.uuid4().hex}"})
    assert cached(answer) == 0
    return answer
