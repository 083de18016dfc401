"""Prefill/decode disaggregation across hosts: the PD router on one host, a producer
(`PagedKVPushConnector`, pushing to the consumer host's address) on a second, the consumer on a
third, the client on a fourth, all over a bridge. Greedy tokens equal transformers', every
request goes through a transfer (the router counts an ok prefill each, the consumer loads
pushed blocks); then a partition between producer and consumer mid-run: every request still
ends in bounded time with the right tokens (the consumer recomputes what never arrived)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from pagedkv.testing.netns import Host, NetnsCluster
from tests.engine.conftest import hf_greedy, make_prompts
from tests.net.conftest import PORT, HostProcess, make_cluster, serve_cmd, url, wait_routable

pytestmark = pytest.mark.timeout(180)  # each test, the first one with the fleet's start

KV_PORT = 14579
MAX_TOKENS = 6
TRANSFER_TIMEOUT_S = 2.0  # how long the consumer waits for pushed blocks
BOUND_S = 15.0  # a request under a partition: the push's send timeout plus the wait, and slack
PROMPT_LENGTHS = (24, 40)  # several blocks of 4 tokens each
ROUTER_FLAGS = ["--pd-prefill-timeout", "10", "--first-byte-timeout", "10",
                "--connect-timeout", "2", "--health-interval", "0.5"]


class Fleet:
    """The hosts (router, producer, consumer, client) and the processes on them."""

    def __init__(self, cluster: NetnsCluster) -> None:
        self.cluster = cluster
        self.router, self.producer, self.consumer, self.client = cluster.hosts
        self.procs: list[HostProcess] = []

    def call(self, fn, *args, timeout: float = 60):
        """`fn(*args)` on the client host."""
        return self.cluster.call(self.client, fn, *args, timeout=timeout)

    def metric(self, host: Host, name: str, **labels: str) -> float:
        return self.call(scrape_sum, url(host), name, labels)


def scrape_sum(base: str, name: str, labels: dict[str, str]) -> float:
    """The sum of `base`/metrics samples of `name` whose labels include `labels` (0 if none)."""
    total = 0.0
    for line in httpx.get(base + "/metrics", timeout=5).text.splitlines():
        if line.startswith("#") or not (line.startswith(name + "{") or
                                        line.startswith(name + " ")):
            continue
        key, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += float(value)
    return total


def complete(base: str, prompt: list[int], timeout: float = 30) -> dict:
    """Greedy token ids of a completion of `prompt` at `base`, and the seconds it took."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    start = time.monotonic()
    resp = httpx.post(base + "/v1/completions", json=body, timeout=timeout)
    resp.raise_for_status()
    return {"tokens": resp.json()["choices"][0]["token_ids"],
            "seconds": time.monotonic() - start}


def pd_router_cmd(model, host: Host, prefill: Host, decode: Host) -> list[str]:
    return [sys.executable, "-m", "pagedkv.cli", "router", "--prefill", url(prefill),
            "--decode", url(decode), "--model", str(model), "--host", host.addr,
            "--port", str(PORT), "--log-level", "warning", *ROUTER_FLAGS]


def transfer_flags(role: str, consumer: Host) -> list[str]:
    timing = {"transfer_timeout_s": TRANSFER_TIMEOUT_S}
    if role == "producer":
        config = {"kv_role": "kv_producer", "kv_connector": "PagedKVPushConnector",
                  "kv_connector_extra_config": {"consumers": [f"{consumer.addr}:{KV_PORT}"],
                                                **timing}}
    else:
        config = {"kv_role": "kv_consumer", "kv_connector": "PagedKVPushConnector",
                  "kv_ip": consumer.addr, "kv_port": KV_PORT,
                  "kv_connector_extra_config": timing}
    return ["--kv-transfer-config", json.dumps(config)]


@pytest.fixture(scope="module")
def fleet(tiny_llama) -> Iterator[Fleet]:
    with make_cluster(4) as cluster:
        fleet = Fleet(cluster)
        starts = [
            (fleet.producer, serve_cmd(tiny_llama, fleet.producer,
                                       *transfer_flags("producer", fleet.consumer))),
            (fleet.consumer, serve_cmd(tiny_llama, fleet.consumer,
                                       *transfer_flags("consumer", fleet.consumer))),
            (fleet.router, pd_router_cmd(tiny_llama, fleet.router, fleet.producer,
                                         fleet.consumer)),
        ]
        fleet.procs = [HostProcess(cluster, host, cmd) for host, cmd in starts]
        try:
            for proc in fleet.procs:
                proc.wait_healthy(url(proc.host))
            wait_routable(cluster, fleet.client, url(fleet.router),
                          [url(fleet.producer), url(fleet.consumer)])
            yield fleet
        finally:
            for proc in fleet.procs:
                proc.stop()


def prefill_ok(fleet: Fleet) -> float:
    return fleet.metric(fleet.router, "pagedkv_router:pd_prefill_requests_total",
                        backend=url(fleet.producer), outcome="ok")


def consumer_loaded(fleet: Fleet) -> float:
    return fleet.metric(fleet.consumer, "vllm:external_prefix_cache_hits_total")


def test_every_request_is_transferred_across_hosts(fleet, tiny_llama):
    prompts = make_prompts(seed=21, vocab=400, num=4, lengths=PROMPT_LENGTHS)
    ok_before, loaded_before = prefill_ok(fleet), consumer_loaded(fleet)
    for prompt in prompts:
        got = fleet.call(complete, url(fleet.router), prompt)
        assert got["tokens"] == hf_greedy(tiny_llama, prompt, MAX_TOKENS)
    fallbacks = {reason: fleet.metric(fleet.router, "pagedkv_router:pd_fallbacks_total",
                                      reason=reason)
                 for reason in ("no_prefill_instance", "timeout", "connect", "read", "no_params")}
    assert prefill_ok(fleet) - ok_before == len(prompts), fallbacks
    assert fleet.metric(fleet.router, "pagedkv_router:pd_fallbacks_total") == 0
    assert fleet.metric(fleet.router, "pagedkv_router:pd_decode_requests_total",
                        transfer="yes") >= len(prompts)
    # The consumer loaded pushed blocks: at least the full blocks of the shortest prompt each.
    assert consumer_loaded(fleet) - loaded_before >= len(prompts) * (PROMPT_LENGTHS[0] // 4 - 1)


def test_a_partition_between_producer_and_consumer_mid_run_is_recomputed(fleet, tiny_llama):
    cluster = fleet.cluster
    prompts = make_prompts(seed=22, vocab=400, num=5, lengths=PROMPT_LENGTHS)
    loaded_at_cut = None
    try:
        for i, prompt in enumerate(prompts):
            if i == 2:  # mid-run: the blocks of the next requests can no longer arrive
                loaded_at_cut = consumer_loaded(fleet)
                cluster.partition(fleet.producer, fleet.consumer)
            got = fleet.call(complete, url(fleet.router), prompt, 2 * BOUND_S,
                             timeout=3 * BOUND_S)
            print(f"\nrequest {i} ({'after' if i >= 2 else 'before'} the cut): "
                  f"{got['seconds']:.2f} s")
            assert got["tokens"] == hf_greedy(tiny_llama, prompt, MAX_TOKENS)
            assert got["seconds"] < BOUND_S
        # Nothing arrived after the cut: the consumer computed those prompts itself.
        assert consumer_loaded(fleet) == loaded_at_cut
    finally:
        cluster.heal(fleet.producer, fleet.consumer)
    for proc in fleet.procs:
        assert proc.proc.poll() is None, proc.output()  # nothing died
