"""The push connector with tensor parallelism (CPU, gloo, 2 ranks): each producer rank pushes its
own KV heads' slice of every block to the consumer's rank of the same index (`kv_port + rank`);
a TP=2 consumer loads each rank's slice, an engine of another size refuses the params and
computes the prompt. A push cut midway on one rank ends in bounded time with the blocks every
rank holds loaded and the rest computed. The answer to a prefill waits for every rank's
saved-through watermark while the engine steps other requests (a rank whose store tier is held
back shows it), and a tier that never finishes costs at most the transfer timeout. Tokens and
logprobs always equal one instance's; every block comes back on every engine."""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.server.app import create_app
from tests.pd.conftest import (
    BLOCK_SIZE,
    PREFILL_PARAMS,
    TRANSFER_TIMEOUT_S,
    assert_same_answer,
    body,
    cached,
    engine_args,
    post,
    utility,
)
from tests.pd.save_gate import worker_save_gate
from tests.pd.test_faults import _CutSocket

PUSH = "PagedKVPushConnector"
MAX_TOKENS = 5
PRODUCER_TIMEOUT_S = 3.0  # how long a producer rank waits for its own saves
BOUND_S = PRODUCER_TIMEOUT_S + TRANSFER_TIMEOUT_S + 5.0
NUM_BLOCKS = 9
def prompt_of(seed: int) -> list[int]:
    return [3 + (seed * 29 + i * 11) % 190 for i in range(NUM_BLOCKS * BLOCK_SIZE + 1)]


def free_port_pair() -> int:
    """A port p such that p and p + 1 are free on 127.0.0.1 (a TP=2 engine's push ports),
    with p + 2 free too (no other engine's port follows)."""
    for _ in range(100):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                for extra in (1, 2):
                    with socket.socket() as probe:
                        probe.bind(("127.0.0.1", port + extra))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports")


@dataclass
class Node:
    engine: LLMEngine
    client: TestClient
    port: int


def _engine(model_dir: Path, role: str, tp: int, port: int, timeout_s: float) -> LLMEngine:
    transfer = {"kv_role": role, "kv_connector": PUSH, "kv_port": port,
                "kv_buffer_size": 2**22,
                "kv_connector_extra_config": {"transfer_timeout_s": timeout_s}}
    return LLMEngine(engine_args(model_dir, transfer, tensor_parallel_size=tp, cpu_kernels="off"))


@pytest.fixture(scope="module")
def gate(tmp_path_factory) -> Path:
    """The file whose existence holds back the worker ranks' store writes."""
    return tmp_path_factory.mktemp("gate") / "held"


@pytest.fixture(scope="module")
def fleet(tiny_llama, tmp_path_factory, gate) -> Iterator[dict[str, Node]]:
    """`p2`: TP=2 producer (and consumer); `c2`: TP=2 consumer; `c1`: TP=1 producer and
    consumer. The TP=2 engines' worker ranks hold their host-tier writes while `gate` exists."""
    specs = {"p2": ("kv_both", 2, PRODUCER_TIMEOUT_S), "c2": ("kv_consumer", 2, TRANSFER_TIMEOUT_S),
             "c1": ("kv_both", 1, TRANSFER_TIMEOUT_S)}
    engines: dict[str, tuple[LLMEngine, int]] = {}
    with contextlib.ExitStack() as stack, \
            worker_save_gate(tmp_path_factory.mktemp("hooks"), gate):
        try:
            for name, (role, tp, timeout_s) in specs.items():
                port = free_port_pair()
                engines[name] = (_engine(tiny_llama, role, tp, port, timeout_s), port)
            yield {name: Node(engine, stack.enter_context(
                TestClient(create_app(engine, served_model_name="m"))), port)
                for name, (engine, port) in engines.items()}
        finally:
            for engine, _ in engines.values():
                engine.shutdown()


def _prefill(producer: Node, consumer: Node, request: dict) -> dict:
    """The proxy's prefill request, naming the consumer to push to; its kv_transfer_params."""
    target = {**PREFILL_PARAMS, "remote_host": "127.0.0.1", "remote_port": consumer.port}
    sent = {**request, "max_tokens": 1, "stream": False}
    params = post(producer.client, sent, target)["kv_transfer_params"]
    assert params["tp_size"] == producer.engine.args.tensor_parallel_size
    return params


def _one_instance(node: Node, request: dict, salt: str) -> dict:
    answer = post(node.client, {**request, "cache_salt": f"one-instance-{salt}"})
    assert cached(answer) == 0
    return answer


def _assert_blocks_back(fleet: dict[str, Node]) -> None:
    for node in fleet.values():
        utility(node.client, "check_invariants")
        stats = utility(node.client, "get_stats")
        kv = node.engine.scheduler.kv_cache_manager
        assert stats.num_running == stats.num_waiting == 0
        assert kv.pool.get_num_free_blocks() == kv.num_usable_blocks


def _block_bytes(node: Node) -> int:
    return utility(node.client, "kv_transfer.describe")["block_bytes"]


def test_each_rank_pushes_its_slice_and_the_tp2_consumer_loads_both(fleet):
    p2, c2, c1 = fleet["p2"], fleet["c2"], fleet["c1"]
    request = body(prompt_of(1), MAX_TOKENS)
    before = utility(c2.client, "kv_transfer.stats")["blocks_received"]
    params = _prefill(p2, c2, request)
    assert params["num_tokens"] == NUM_BLOCKS * BLOCK_SIZE and params["durable"] is True
    # both ranks pushed every block: twice rank 0's bytes (a rank's block: its half of the heads)
    assert params["transfer_bytes"] == 2 * NUM_BLOCKS * _block_bytes(p2)
    decoded = post(c2.client, request, params)
    assert cached(decoded) == NUM_BLOCKS * BLOCK_SIZE  # every rank loaded its slice
    assert utility(c2.client, "kv_transfer.stats")["blocks_received"] - before == NUM_BLOCKS
    assert_same_answer(decoded, _one_instance(c1, request, "tp2"))
    assert_same_answer(decoded, _one_instance(c2, request, "tp2"))
    _assert_blocks_back(fleet)


@pytest.mark.parametrize(("producer", "consumer"), [("p2", "c1"), ("c1", "c2")])
def test_another_tp_size_is_refused_and_the_prompt_computed(fleet, producer, consumer, caplog):
    request = body(prompt_of(2 if producer == "p2" else 3), MAX_TOKENS)
    start = time.monotonic()
    params = _prefill(fleet[producer], fleet[consumer], request)
    with caplog.at_level(logging.WARNING, logger="pagedkv.server"):
        decoded = post(fleet[consumer].client, request, params)
    assert time.monotonic() - start < BOUND_S
    size = fleet[producer].engine.args.tensor_parallel_size
    assert f"tp_size {size} is not this engine's" in caplog.text
    assert cached(decoded) == 0  # the other size's blocks (under its keys) were never read
    assert_same_answer(decoded, _one_instance(fleet[consumer], request, f"{producer}-{consumer}"))
    _assert_blocks_back(fleet)


def test_a_push_cut_midway_on_one_rank_is_recomputed_in_bounded_time(fleet, monkeypatch, caplog):
    """Rank 0 sends two of four layer-group chunks: none of its slices is whole, so no block
    is loaded on any rank (rank 1's whole slices alone would be wrong KV)."""
    sender = fleet["p2"].engine.core.kv_transfer.sender
    real = sender._socket
    monkeypatch.setattr(sender, "_socket", lambda address: _CutSocket(real(address), 2))
    p2, c2 = fleet["p2"], fleet["c2"]
    request = body(prompt_of(4), MAX_TOKENS)
    start = time.monotonic()
    params = _prefill(p2, c2, request)
    with caplog.at_level(logging.WARNING, logger="pagedkv.server"):
        decoded = post(c2.client, request, params)
    assert time.monotonic() - start < BOUND_S
    assert f"0 of {NUM_BLOCKS} pushed blocks arrived" in caplog.text
    assert cached(decoded) == 0
    assert_same_answer(decoded, _one_instance(fleet["c1"], request, "cut"))
    _assert_blocks_back(fleet)


def test_only_blocks_every_rank_holds_are_loaded(fleet, monkeypatch):
    """Rank 0 pushes three whole blocks, rank 1 all nine: exactly three are loaded."""
    sender = fleet["p2"].engine.core.kv_transfer.sender
    real_push = sender.push
    monkeypatch.setattr(sender, "push", lambda address, keys, payloads, *rest:
                        real_push(address, keys[:3], payloads[:3], *rest))
    p2, c2 = fleet["p2"], fleet["c2"]
    request = body(prompt_of(5), MAX_TOKENS)
    decoded = post(c2.client, request, _prefill(p2, c2, request))
    assert cached(decoded) == 3 * BLOCK_SIZE
    assert_same_answer(decoded, _one_instance(fleet["c1"], request, "partial"))
    _assert_blocks_back(fleet)


def test_the_answer_waits_for_every_ranks_saves_while_the_engine_steps(fleet, gate):
    """Rank 1's writes are held: other requests run to completion meanwhile, the prefill's
    answer comes only after the hold ends, and the consumer then finds every block."""
    p2, c2 = fleet["p2"], fleet["c2"]
    request = body(prompt_of(6), MAX_TOKENS)
    gate.touch()
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(_prefill, p2, c2, request)
            time.sleep(0.2)  # the prefill runs; its rank 1 saves are held
            for seed in (7, 8):  # the engine steps other requests to the end meanwhile
                other = post(p2.client, body(prompt_of(seed)[:9], 3, cache_salt="other"))
                assert len(other["choices"][0]["logprobs"]["tokens"]) == 3
            assert not pending.done()  # no answer before rank 1's saves are written
            gate.unlink()
            params = pending.result(timeout=BOUND_S)
    finally:
        gate.unlink(missing_ok=True)
    assert params["durable"] is True and params["num_tokens"] == NUM_BLOCKS * BLOCK_SIZE
    decoded = post(c2.client, request, params)
    assert cached(decoded) == NUM_BLOCKS * BLOCK_SIZE
    assert_same_answer(decoded, _one_instance(fleet["c1"], request, "held"))
    _assert_blocks_back(fleet)


def test_saves_that_never_finish_cost_at_most_the_transfer_timeout(fleet, gate):
    """Rank 1's writes stay held: the answer comes after the producer's transfer timeout,
    saying no block is durable, and the decode computes the prompt."""
    p2, c2 = fleet["p2"], fleet["c2"]
    request = body(prompt_of(9), MAX_TOKENS)
    gate.touch()
    try:
        start = time.monotonic()
        params = _prefill(p2, c2, request)
        waited = time.monotonic() - start
    finally:
        gate.unlink()
    assert PRODUCER_TIMEOUT_S <= waited < BOUND_S
    assert params["durable"] is False and params["num_tokens"] == 0
    decoded = post(c2.client, request, params)
    assert cached(decoded) == 0
    assert_same_answer(decoded, _one_instance(fleet["c1"], request, "never"))
    _assert_blocks_back(fleet)
