"""Prefill/decode disaggregation with tensor parallelism (CPU, gloo, 2 ranks) through the store
connector: a TP=2 producer's blocks (each rank's KV heads under its own rank's keys) are loaded
by a TP=2 consumer, each rank its own share; a consumer of another size refuses the params with
a reason naming `tp_size` and computes the prompt. The producer answers only once every rank's
saves are written, while its engine steps other requests (a worker rank's held-back shared tier
shows it). Either way tokens and logprobs equal one instance's and transformers', and every
block comes back on every engine."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.http.protocol import KVTransferParams
from pagedkv.server.app import create_app
from pagedkv.server.kv_transfer import mismatch
from tests.engine.conftest import hf_greedy
from tests.pd.conftest import (
    BLOCK_SIZE,
    assert_same_answer,
    body,
    cached,
    engine_args,
    post,
    prefill,
    utility,
)
from tests.pd.save_gate import worker_save_gate

STORE = "PagedKVStoreConnector"
MAX_TOKENS = 6
PROMPT = [5 + (i * 7) % 180 for i in range(37)]  # 9 full blocks and one token
SAVE_TIMEOUT_S = 3.0  # how long a producer rank waits for its own saves


def _engine(model_dir: Path, shared: Path, role: str, tp: int) -> LLMEngine:
    transfer = {"kv_role": role, "kv_connector": STORE,
                "kv_connector_extra_config": {"transfer_timeout_s": SAVE_TIMEOUT_S}}
    return LLMEngine(engine_args(model_dir, transfer, tensor_parallel_size=tp, cpu_kernels="off",
                                 kv_offloading_disk_path=str(shared),
                                 kv_offloading_disk_size=0.1))


@pytest.fixture(scope="module")
def gate(tmp_path_factory) -> Path:
    """The file whose existence holds back the worker ranks' store writes."""
    return tmp_path_factory.mktemp("gate") / "held"


@pytest.fixture(scope="module")
def fleet(tiny_llama, tmp_path_factory, gate) -> Iterator[dict[str, Any]]:
    """Over one shared disk tier: `tp2` (TP=2, producer and consumer), `tp1` (TP=1, producer
    and consumer) and `tp2c` (a second TP=2 engine, consumer): name -> (engine, client). The
    worker ranks hold their writes while `gate` exists."""
    shared = tmp_path_factory.mktemp("pd-tp") / "shared"
    specs = {"tp2": ("kv_both", 2), "tp1": ("kv_both", 1), "tp2c": ("kv_consumer", 2)}
    engines: dict[str, LLMEngine] = {}
    with contextlib.ExitStack() as stack, \
            worker_save_gate(tmp_path_factory.mktemp("hooks"), gate):
        try:
            for name, (role, tp) in specs.items():
                engines[name] = _engine(tiny_llama, shared, role, tp)
            clients = {name: stack.enter_context(TestClient(create_app(e, served_model_name="m")))
                       for name, e in engines.items()}
            yield {name: (engines[name], clients[name]) for name in specs}
        finally:
            for engine in engines.values():
                engine.shutdown()


def _assert_blocks_back(engine: LLMEngine, client: TestClient) -> None:
    utility(client, "check_invariants")
    stats = utility(client, "get_stats")
    kv = engine.scheduler.kv_cache_manager
    assert stats.num_running == stats.num_waiting == 0
    assert kv.pool.get_num_free_blocks() == kv.num_usable_blocks


def _one_instance(client: TestClient, request: dict, salt: str) -> dict:
    answer = post(client, {**request, "cache_salt": f"one-instance-{salt}"})
    assert cached(answer) == 0
    return answer


def _disaggregate(fleet: dict, producer: str, consumer: str, salt: str) -> tuple[dict, dict]:
    """The proxy's two requests, salted apart from every other test's: (params, decoded)."""
    request = body(PROMPT, MAX_TOKENS, cache_salt=salt)
    params = prefill(fleet[producer][1], request)["kv_transfer_params"]
    assert params["tp_size"] == fleet[producer][0].args.tensor_parallel_size
    assert params["num_tokens"] == 9 * BLOCK_SIZE  # every rank's blocks are in the shared tier
    assert params["durable"] is True
    return params, post(fleet[consumer][1], request, params)


def test_tp2_producer_to_tp2_consumer_loads_each_ranks_blocks(fleet, tiny_llama):
    params, decoded = _disaggregate(fleet, "tp2", "tp2c", "tp2-tp2")
    assert cached(decoded) == 9 * BLOCK_SIZE  # both ranks loaded their heads, none computed
    request = body(PROMPT, MAX_TOKENS)
    assert_same_answer(decoded, _one_instance(fleet["tp2c"][1], request, "a"))
    assert_same_answer(decoded, _one_instance(fleet["tp1"][1], request, "a"))
    tokens = post(fleet["tp2c"][1], {**request, "logprobs": None, "return_token_ids": True,
                                     "cache_salt": "hf"})["choices"][0]["token_ids"]
    assert tokens == hf_greedy(tiny_llama, PROMPT, MAX_TOKENS)
    for engine, client in fleet.values():
        _assert_blocks_back(engine, client)


@pytest.mark.parametrize(("producer", "consumer"), [("tp2", "tp1"), ("tp1", "tp2")])
def test_another_tp_size_is_refused_and_the_prompt_computed(fleet, producer, consumer, caplog):
    salt = f"{producer}-{consumer}"
    with caplog.at_level("WARNING", logger="pagedkv.server"):
        params, decoded = _disaggregate(fleet, producer, consumer, salt)
    size = fleet[producer][0].args.tensor_parallel_size
    assert f"tp_size {size} is not this engine's" in caplog.text
    assert cached(decoded) == 0  # nothing loaded: the other size's keys were never read
    request = body(PROMPT, MAX_TOKENS)
    assert_same_answer(decoded, _one_instance(fleet[consumer][1], request, salt))
    assert_same_answer(decoded, _one_instance(fleet[producer][1], request, salt))
    for engine, client in fleet.values():
        _assert_blocks_back(engine, client)


def test_the_tp_check_comes_first_and_an_absent_tp_size_leaves_it_to_the_identity():
    desc = {"model_identity": "m", "kv_format": "f", "block_size": 4}
    params = KVTransferParams(do_remote_prefill=True, tp_size=2, model_identity="m",
                              kv_format="f", block_size=4, block_hashes=[], num_tokens=0,
                              transport="store")
    assert "tp_size 2" in mismatch(params, desc, [], None, push=False, tp_size=1)
    assert mismatch(params, desc, [], None, push=False, tp_size=2) is None
    unsized = params.model_copy(update={"tp_size": None, "model_identity": "other"})
    assert "model identity" in mismatch(unsized, desc, [], None, push=False, tp_size=1)


def test_the_answer_waits_for_every_ranks_saves_while_the_engine_steps(fleet, gate):
    """Rank 1's shared-tier writes are held: the producer's engine runs other requests to the
    end meanwhile, its answer comes only after the hold ends, and a consumer reading right
    after the answer loads every block on both ranks."""
    request = body(PROMPT, MAX_TOKENS, cache_salt="held")
    gate.touch()
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(prefill, fleet["tp2"][1], request)
            time.sleep(0.2)  # the prefill runs; its rank 1 saves are held
            for n in (9, 10):  # the engine steps other requests to the end meanwhile
                other = post(fleet["tp2"][1], body(PROMPT[:n], 3, cache_salt="other"))
                assert len(other["choices"][0]["logprobs"]["tokens"]) == 3
            assert not pending.done()  # no answer before rank 1's saves are written
            gate.unlink()
            params = pending.result(timeout=SAVE_TIMEOUT_S + 10)["kv_transfer_params"]
    finally:
        gate.unlink(missing_ok=True)
    assert params["durable"] is True and params["num_tokens"] == 9 * BLOCK_SIZE
    decoded = post(fleet["tp2c"][1], request, params)
    assert cached(decoded) == 9 * BLOCK_SIZE
    assert_same_answer(decoded, _one_instance(fleet["tp1"][1], body(PROMPT, MAX_TOKENS), "held"))
    for engine, client in fleet.values():
        _assert_blocks_back(engine, client)
