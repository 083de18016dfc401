"""Two real `pagedkv serve` processes publishing KV events over ZMQ, and a real `pagedkv router`
subscribed to them: a prefix computed on a backend behind the router's back (a request sent to
the backend directly, which the router's own record never saw) is learned from that backend's
`BlockStored` events, and the router sends the next request with that prefix there. The two
backends keep their KV caches in different formats (the model's float32, and int8): the
events and the prefix hashes do not depend on it, and the router's fleet view names each."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.router.helpers import RouterProcess, router_metric
from tests.server.helpers import ENGINE_KWARGS, ServerProcess, engine_flags, free_port

BACKEND_HEADER = "x-pagedkv-backend"
PREFIXES = [f"{name} support desk. " + " ".join(f"{name} policy {i} holds for every ticket."
                                                for i in range(12))
            for name in ("Globex", "Initech")]
FORMATS = ("auto", "int8")  # the backends' KV cache formats


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    ports = [free_port(), free_port()]
    backends = [ServerProcess(tiny_llama, *engine_flags(**ENGINE_KWARGS, kv_cache_dtype=fmt),
                              "--kv-events-config",
                              json.dumps({"enable_kv_cache_events": True,
                                          "endpoint": f"tcp://*:{port}"}))  # bind (vLLM rule)
                for port, fmt in zip(ports, FORMATS, strict=True)]
    router = None
    try:
        for b in backends:
            b.start()
        events = [f for port in ports for f in ("--kv-events", f"tcp://127.0.0.1:{port}")]
        router = RouterProcess(tiny_llama, [b.url for b in backends], *events,
                               "--health-interval", "0.3").start()
        yield router, backends
    finally:
        clean = router.stop() if router is not None else True
        for b in backends:
            b.stop()
    assert clean, "router did not shut down cleanly"


def complete(url: str, prompt: str) -> httpx.Response:
    resp = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0.0,
        "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return resp


def events_seen(router: RouterProcess, backend: ServerProcess) -> float:
    return router_metric(router.url, "pagedkv_router:kv_events_total", backend=backend.url)


def wait_for_events(router: RouterProcess, backend: ServerProcess, above: float,
                    prompt: str | None = None, timeout: float = 30.0) -> float:
    """Wait until the router has applied more than `above` events of `backend` (sending `prompt`
    to the backend again each round when given: events published before the router's SUB
    socket connected are lost, as with any ZMQ PUB/SUB)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if prompt is not None:
            complete(backend.url, prompt)
        seen = events_seen(router, backend)
        if seen > above:
            return seen
        time.sleep(0.2)
    raise AssertionError(f"the router applied no KV events of {backend.url} in {timeout} s")


def test_prefixes_learned_from_kv_events_route_to_their_backends(cluster):
    router, backends = cluster
    # Each prefix is computed on a different backend directly, so only that backend's KV events
    # can tell the router where it is (the router's own record never saw these requests).
    targets = [backends[1], backends[0]]
    for prefix, target in zip(PREFIXES, targets, strict=True):
        # The subscription is live once a warm-up request's events arrive.
        seen = wait_for_events(router, target, 0, prompt="warm up the event stream please")
        complete(target.url, prefix + " First question?")
        wait_for_events(router, target, seen)
    for i in range(2):
        for prefix, target in zip(PREFIXES, targets, strict=True):
            resp = complete(router.url, prefix + f" Question {i}?")
            assert resp.headers[BACKEND_HEADER] == target.url
            cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= ENGINE_KWARGS["block_size"] * 20, cached
    for target in targets:
        assert router_metric(router.url, "pagedkv_router:predicted_prefix_hit_blocks_total",
                             backend=target.url) > 0
    fleet = httpx.get(router.url + "/dashboard/fleet", timeout=10).json()
    assert {b["name"]: b["kv_cache_dtype"] for b in fleet["backends"]} == \
        {backends[0].url: "float32", backends[1].url: "int8"}
