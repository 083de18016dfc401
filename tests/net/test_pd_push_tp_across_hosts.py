"""Prefill/decode disaggregation with tensor parallelism across hosts: a TP=2 producer
(`PagedKVPushConnector`) on one host pushes each rank's slice of a request's blocks to a TP=2
consumer on a second (its rank r listening on `kv_port + r`), driven by a client on a third
with the two requests vLLM's PD proxy sends. Greedy tokens equal transformers' and the consumer
loads every full prompt block; under a partition between producer and consumer each request
still ends in bounded time with the right tokens (the consumer computes the prompt)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from pagedkv.testing.netns import NetnsCluster
from tests.engine.conftest import hf_greedy, make_prompts
from tests.net.conftest import HostProcess, make_cluster, serve_cmd, url

pytestmark = pytest.mark.timeout(240)  # each test, the first one with the fleet's start

KV_PORT = 14579
MAX_TOKENS = 5
BLOCK_SIZE = 4
TRANSFER_TIMEOUT_S = 2.0
BOUND_S = 15.0  # a request under a partition: the push's send timeout plus the waits, and slack
PROMPT_LENGTHS = (25, 41)
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}


def transfer_flags(role: str, consumer_addr: str) -> list[str]:
    config = {"kv_role": role, "kv_connector": "PagedKVPushConnector",
              "kv_connector_extra_config": {"transfer_timeout_s": TRANSFER_TIMEOUT_S}}
    if role == "kv_producer":
        config["kv_connector_extra_config"]["consumers"] = [f"{consumer_addr}:{KV_PORT}"]
    else:
        config.update(kv_ip=consumer_addr, kv_port=KV_PORT)
    return ["--kv-transfer-config", json.dumps(config), "--tensor-parallel-size", "2"]


@pytest.fixture(scope="module")
def fleet(tiny_llama) -> Iterator[tuple[NetnsCluster, list[HostProcess]]]:
    with make_cluster(3) as cluster:
        producer, consumer, _ = cluster.hosts
        procs = [HostProcess(cluster, host, serve_cmd(tiny_llama, host,
                                                      *transfer_flags(role, consumer.addr)))
                 for host, role in ((producer, "kv_producer"), (consumer, "kv_consumer"))]
        try:
            for proc in procs:
                proc.wait_healthy(url(proc.host))
            yield cluster, procs
        finally:
            for proc in procs:
                proc.stop()


def disaggregate(producer: str, consumer: str, prompt: list[int]) -> dict:
    """The proxy's prefill on `producer`, then the decode on `consumer` with its params: the
    decode's token ids, its cached tokens and the seconds both took."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    start = time.monotonic()
    first = httpx.post(producer + "/v1/completions", timeout=60, json={
        **body, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS})
    first.raise_for_status()
    params = first.json()["kv_transfer_params"]
    second = httpx.post(consumer + "/v1/completions", timeout=60,
                        json={**body, "kv_transfer_params": params})
    second.raise_for_status()
    answer = second.json()
    return {"tokens": answer["choices"][0]["token_ids"], "tp_size": params["tp_size"],
            "cached": answer["usage"]["prompt_tokens_details"]["cached_tokens"],
            "seconds": time.monotonic() - start}


def test_each_ranks_slice_crosses_hosts(fleet, tiny_llama):
    cluster, (producer, consumer) = fleet
    client = cluster.hosts[2]
    for prompt in make_prompts(seed=31, vocab=400, num=3, shared_prefix=0,
                                lengths=PROMPT_LENGTHS):
        got = cluster.call(client, disaggregate, url(producer.host), url(consumer.host), prompt)
        assert got["tokens"] == hf_greedy(tiny_llama, prompt, MAX_TOKENS)
        assert got["tp_size"] == 2
        # every full block but one holding the last token (always computed): both ranks' slices
        assert got["cached"] == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_a_partition_between_the_tp_engines_is_recomputed_in_bounded_time(fleet, tiny_llama):
    cluster, (producer, consumer) = fleet
    client = cluster.hosts[2]
    cluster.partition(producer.host, consumer.host)
    try:
        for prompt in make_prompts(seed=32, vocab=400, num=2, shared_prefix=0,
                                lengths=PROMPT_LENGTHS):
            got = cluster.call(client, disaggregate, url(producer.host), url(consumer.host),
                               prompt, timeout=3 * BOUND_S)
            assert got["tokens"] == hf_greedy(tiny_llama, prompt, MAX_TOKENS)
            assert got["cached"] == 0 and got["seconds"] < BOUND_S
    finally:
        cluster.heal(producer.host, consumer.host)
    for proc in (producer, consumer):
        assert proc.proc.poll() is None, proc.output()  # nothing died
