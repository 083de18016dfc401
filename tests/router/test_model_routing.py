"""Routing by `model` (issue 20): a request goes only to backends serving its model (learned
from their /v1/models with the health checks); a model no backend serves is a 404 as on the
server; prefix credit counts within one model only; a backend with prefix caching off gets
none."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import httpx
import pytest

from pagedkv.events.wire import BlockStored, KVEventBatch
from pagedkv.http.protocol import ModelCard
from pagedkv.router.backend import Backend
from pagedkv.router.health import HealthChecker
from pagedkv.router.kv_events import apply_batch
from pagedkv.router.policies import Candidate, KVAwarePolicy, RouteRequest
from pagedkv.router.prefix_index import PrefixMatch
from pagedkv.router.router import Router
from tests.router.fake_backend import FakeBackend
from tests.router.test_faults import router_server

pytestmark = pytest.mark.timeout(60, method="thread")

H = tuple(bytes([i]) * 32 for i in range(4))  # a prompt of 4 full blocks
KV_INFO = {"block_size": 4, "prefix_caching_hash_algo": "sha256", "num_gpu_blocks": 64,
           "enable_prefix_caching": True}


def test_requests_go_only_to_backends_serving_their_model():
    with FakeBackend("ok", model="mA") as a, FakeBackend("ok", model="mB") as b:
        router, server = router_server(a, b)
        with server, httpx.Client(timeout=20) as client:
            def post(model: str | None) -> httpx.Response:
                body = {"prompt": "x"} if model is None else {"prompt": "x", "model": model}
                return client.post(server.url + "/v1/completions", json=body)

            for_a = [post("mA") for _ in range(4)]
            for_b = [post("mB") for _ in range(4)]
            assert [r.status_code for r in for_a + for_b] == [200] * 8
            assert {r.headers["x-pagedkv-backend"] for r in for_a} == {a.url}
            assert {r.headers["x-pagedkv-backend"] for r in for_b} == {b.url}
            unknown = post("mC")
            assert unknown.status_code == 404
            assert unknown.json()["error"]["code"] == "model_not_found"
            assert {post(None).headers["x-pagedkv-backend"] for _ in range(2)} == {a.url, b.url}
            models = client.get(server.url + "/v1/models").json()["data"]
            assert sorted(m["id"] for m in models) == ["mA", "mB"]
        assert (a.attempts, b.attempts) == (5, 5)


def test_models_are_refreshed_by_the_health_checks_and_a_change_drops_the_prefixes():
    served = {"a.test": "mA"}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            assert request.headers["authorization"] == "Bearer backend-key"
            return httpx.Response(200, json={"data": [{"id": served["a.test"]}, "junk"]})
        if request.url.path == "/kv_cache_info":
            return httpx.Response(200, json=KV_INFO)
        return httpx.Response(200, text="")

    async def scenario() -> None:
        router = Router([Backend("http://a.test")], KVAwarePolicy())
        backend = router.backends[0]
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            checker = HealthChecker(router, client, info_interval_s=0,
                                    headers={"authorization": "Bearer backend-key"})
            assert await checker.check(backend)
            assert backend.models == {"mA"} and backend.only_model == "mA"
            assert router.knows_model("mA") and router.knows_model("mB") is False
            router.index.store(backend.name, H, model="mA")
            served["a.test"] = "mB"  # another model behind the same URL now
            assert await checker.check(backend)
            assert backend.models == {"mB"} and router.knows_model("mA") is False
            assert router.index.num_blocks(backend.name, model="mA") == 0

    asyncio.run(scenario())


class RecordingPolicy(KVAwarePolicy):
    """kv-aware, keeping the candidates of its last choice."""

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> int:
        self.seen = {c.name: c.match for c in candidates}
        return super().choose(request, candidates)


def make_router(models: dict[str, str], prefix_caching: dict[str, bool] | None = None):
    backends = [Backend(url, up=True) for url in models]
    policy = RecordingPolicy()
    router = Router(backends, policy)
    for backend in backends:
        router.set_models(backend, [ModelCard(id=models[backend.url])])
        caching = (prefix_caching or {}).get(backend.url, True)
        router.set_kv_info(backend, {**KV_INFO, "enable_prefix_caching": caching})
    return router, policy


def test_prefix_credit_counts_within_one_model():
    a, b, c = "http://a.test", "http://b.test", "http://c.test"
    router, policy = make_router({a: "mA", b: "mB", c: "mA"})
    # b (model mB) publishes the prompt's blocks on its device and on the shared Redis tier.
    apply_batch(router.index, b, KVEventBatch(ts=0.0, events=[
        BlockStored(block_hashes=list(H), parent_block_hash=None, token_ids=[],
                    block_size=4, medium="GPU"),
        BlockStored(block_hashes=list(H), parent_block_hash=None, token_ids=[],
                    block_size=4, medium="REDIS")]), model="mB")
    backend, _ = router.route(RouteRequest(prompt_tokens=16, block_hashes=H, model="mA"))
    assert set(policy.seen) == {a, c}  # b serves another model: never a candidate
    assert policy.seen[a] == policy.seen[c] == PrefixMatch(0, 0)  # mB's Redis blocks: no credit
    for_b = router.route(RouteRequest(prompt_tokens=16, block_hashes=H, model="mB"))
    assert for_b[0].name == b and policy.seen[b] == PrefixMatch(device_blocks=4)
    # Own record (no events): a prompt sent to a for mA counts for mA only.
    router.begin(backend, RouteRequest(prompt_tokens=16, block_hashes=H, model="mA"),
                 Candidate(name=backend.name)).end()
    assert router.index.match(backend.name, H, "mA").device_blocks == 4
    # (for mB, a would see only mB's shared Redis blocks, never a's own mA record)
    assert router.index.match(backend.name, H, "mB") == PrefixMatch(0, 4)


def test_a_backend_with_prefix_caching_off_gets_no_prefix_credit():
    a, b = "http://a.test", "http://b.test"
    router, policy = make_router({a: "m", b: "m"}, prefix_caching={b: False})
    assert router.backend(a).hash_compatible and not router.backend(b).hash_compatible
    for medium in ("GPU", "REDIS"):  # whatever b's events claim, on its device or shared
        router.index.store(b, H, medium=medium, model="m")
    request = RouteRequest(prompt_tokens=16, block_hashes=H, model="m")
    router.route(request)
    assert policy.seen[b] == PrefixMatch(0, 0)
    assert policy.seen[a] == PrefixMatch(device_blocks=0, tier_blocks=4)  # Redis: a can load
    # Nor does the router's own record credit it: a prompt sent there is not recorded.
    router.index.clear(b)
    router.begin(router.backend(b), request, Candidate(name=b)).end()
    assert router.index.num_blocks(b, model="m") == 0


def test_prefix_caching_turned_off_behind_the_same_url_is_seen_by_the_next_health_round():
    info = dict(KV_INFO)

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if request.url.path == "/kv_cache_info":
            return httpx.Response(200, json=info)
        return httpx.Response(200, text="")

    async def scenario() -> None:
        router = Router([Backend("http://a.test")], RecordingPolicy())
        backend = router.backends[0]
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            checker = HealthChecker(router, client, info_interval_s=0)  # info every round
            assert await checker.check(backend) and backend.hash_compatible
            router.index.store(backend.name, H, model="m")
            request = RouteRequest(prompt_tokens=16, block_hashes=H, model="m")
            router.route(request)
            assert router.policy.seen[backend.name] == PrefixMatch(device_blocks=4)
            info["enable_prefix_caching"] = False  # restarted without prefix caching
            assert await checker.check(backend) and not backend.hash_compatible
            router.route(request)
            assert router.policy.seen[backend.name] == PrefixMatch(0, 0)
            assert router.index.num_blocks(backend.name, model="m") == 0

    asyncio.run(scenario())
