"""The router app against fake backends (httpx.MockTransport): retries before the first byte,
the error event of a stream cut after it, health marking, the API key, /v1/models merging."""

from __future__ import annotations

import asyncio
import json

import httpx
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.router.app import create_router_app
from pagedkv.router.backend import LOAD_GAUGES, Backend, BackendLoad, parse_load
from pagedkv.router.health import HealthChecker
from pagedkv.router.policies import make_policy
from pagedkv.router.router import Router

A, B = "http://a.test", "http://b.test"
METRICS = ("# TYPE pagedkv:num_requests_running gauge\npagedkv:num_requests_running 2\n"
           "# TYPE pagedkv:kv_cache_usage_perc gauge\npagedkv:kv_cache_usage_perc 0.25\n")
OK_BODY = {"id": "cmpl-1", "object": "text_completion", "choices": [{"text": "hi"}]}


class CutStream(httpx.AsyncByteStream):
    """One SSE chunk, then the connection drops."""

    async def __aiter__(self):
        yield b'data: {"choices":[{"text":"par'
        raise httpx.ReadError("connection reset")


class FakeBackends:
    """`completions[url]` says how each backend answers a completion: "ok", "500", "refuse",
    or "cut" (a stream that drops after its first chunk). Every request is logged."""

    def __init__(self, **completions: str) -> None:
        self.completions = {A: "ok", B: "ok", **completions}
        self.healthy = {A: True, B: True}
        self.log: list[tuple[str, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}"
        path = request.url.path
        self.log.append((base, path))
        if path == "/health":
            if not self.healthy[base]:
                raise httpx.ConnectError("refused")
            return httpx.Response(200)
        if path == "/kv_cache_info":
            return httpx.Response(200, json={"block_size": 4, "prefix_caching_hash_algo":
                                             "sha256", "num_gpu_blocks": 64})
        if path == "/metrics":
            return httpx.Response(200, text=METRICS)
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": "tiny", "object": "model"}, {"id": f"only-{request.url.host}"},
                {"id": 3}, "junk"]})
        mode = self.completions[base]
        if mode == "refuse":
            raise httpx.ConnectError("refused")
        if mode == "500":
            return httpx.Response(500, json={"error": {"message": "boom"}})
        if mode == "cut":
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  stream=CutStream())
        return httpx.Response(200, json=OK_BODY)


def make_app(fake: FakeBackends, **kwargs):
    router = Router([Backend(A), Backend(B)], make_policy("round-robin"))
    app = create_router_app(router, transport=httpx.MockTransport(fake),
                            health_interval_s=60, **kwargs)
    return router, app


def sample(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus exposition (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


def completion_posts(fake: FakeBackends) -> list[str]:
    return [base for base, path in fake.log if path == "/v1/completions"]


def test_a_5xx_is_retried_on_the_other_backend():
    fake = FakeBackends(**{A: "500"})
    router, app = make_app(fake)
    with TestClient(app) as client:
        for _ in range(2):
            resp = client.post("/v1/completions", json={"prompt": "x"})
            assert resp.status_code == 200 and resp.json() == OK_BODY
            assert resp.headers["x-pagedkv-backend"] == B
        metrics = client.get("/metrics").text
    assert completion_posts(fake).count(B) == 2
    tried_a = completion_posts(fake).count(A)
    assert tried_a >= 1
    assert sample(metrics, "pagedkv_router:retries_total", backend=A,
                  reason="status_500") == tried_a
    assert sample(metrics, "pagedkv_router:requests_total", backend=B, status="200") == 2
    assert router.backend(A).up  # a 5xx answer is not a dead backend
    assert router.backend(A).in_flight == router.backend(B).in_flight == 0


def test_responses_are_forwarded():
    """/v1/responses (the OpenAI Agents SDK's default API) goes to a backend, as vLLM serves
    it; it was a 404 at the router."""
    fake = FakeBackends()
    router, app = make_app(fake)
    with TestClient(app) as client:
        resp = client.post("/v1/responses", json={"model": "tiny", "input": "hi"})
    assert resp.status_code == 200 and resp.json() == OK_BODY
    assert [p for _, p in fake.log if p.startswith("/v1/r")] == ["/v1/responses"]
    assert router.backend(A).in_flight == router.backend(B).in_flight == 0


def test_a_body_over_max_request_bytes_is_a_413_and_never_forwarded():
    fake = FakeBackends()
    _, app = make_app(fake, max_request_bytes=1024)
    with TestClient(app) as client:
        resp = client.post("/v1/completions", json={"prompt": "x" * 2000})
        assert resp.status_code == 413
        assert "error" in resp.json()
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    assert len(completion_posts(fake)) == 1


def test_a_refused_connection_marks_down_and_retries():
    fake = FakeBackends(**{A: "refuse"})
    router, app = make_app(fake)
    with TestClient(app) as client:
        resp = client.post("/v1/completions", json={"prompt": "x", "stream": False})
        assert resp.status_code == 200 and resp.headers["x-pagedkv-backend"] == B
        assert not router.backend(A).up
        assert router.index.num_blocks(A) == 0


def test_all_backends_failing_relays_the_last_5xx_or_503():
    fake = FakeBackends(**{A: "500", B: "500"})
    _, app = make_app(fake)
    with TestClient(app) as client:
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 500
        fake.completions = {A: "refuse", B: "refuse"}
        resp = client.post("/v1/completions", json={"prompt": "x"})
        assert resp.status_code == 503
        assert resp.json()["error"]["type"] == "server_unavailable"
        assert client.get("/health").status_code == 503  # both marked down


def test_a_stream_cut_after_its_first_byte_ends_with_an_error_event_and_done():
    fake = FakeBackends(**{A: "cut", B: "cut"})
    router, app = make_app(fake)
    with TestClient(app) as client:
        resp = client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert resp.status_code == 200
    events = [e for e in resp.text.split("\n\n") if e]
    assert events[0] == 'data: {"choices":[{"text":"par'  # relayed as it came
    assert json.loads(events[1][len("data: "):])["error"]["type"] == "server_unavailable"
    assert events[2] == "data: [DONE]"
    assert len(completion_posts(fake)) == 1  # no retry once bytes reached the client
    assert sum(b.in_flight for b in router.backends) == 0


def test_health_load_scrape_models_and_api_key():
    fake = FakeBackends()
    router, app = make_app(fake, api_key="sekret")
    with TestClient(app) as client:
        assert router.backend(A).up and router.backend(A).load.running == 2
        assert router.backend(A).load.kv_usage == 0.25
        assert router.hash_settings == (4, "sha256")
        assert client.get("/v1/models").status_code == 401
        auth = {"Authorization": "Bearer sekret"}
        ids = [m["id"] for m in client.get("/v1/models", headers=auth).json()["data"]]
        assert ids == ["tiny", "only-a.test", "only-b.test"]
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 401
        assert client.post("/v1/completions", json={"prompt": "x"},
                           headers=auth).status_code == 200


FULL_EXPOSITION = """# HELP vllm:num_requests_running Requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="a b}c"} 2.0
vllm:num_requests_running{engine="0",model_name="other"} 3.0
# TYPE vllm:num_requests_running_extra gauge
vllm:num_requests_running_extra 100.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="x"} 4.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="x"} 5.0
vllm:time_to_first_token_seconds_count{model_name="x"} 5.0
vllm:time_to_first_token_seconds_sum{model_name="x"} 0.3
vllm:num_requests_waiting{engine="0",model_name="x"} 7.0 1700000000000
vllm:kv_cache_usage_perc{engine="0",model_name="x"} 0.5
vllm:kv_cache_usage_perc{engine="0",model_name="y"} 0.75
"""


def test_load_scrape_asks_for_the_gauges_alone_and_reads_a_whole_exposition():
    """The scrape names the load gauges (`name[]`, so the backend renders nothing else); a
    backend that ignores the filter still parses: gauges summed over their samples (KV usage
    the largest), longer names sharing a prefix and every other family left out."""
    assert parse_load(FULL_EXPOSITION) == BackendLoad(running=5, waiting=7, kv_usage=0.75)
    assert parse_load("") == BackendLoad()
    asked: list[list[str]] = []
    fake = FakeBackends()

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            asked.append(request.url.params.get_list("name[]"))
            return httpx.Response(200, text=FULL_EXPOSITION)
        return fake(request)

    async def scenario() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            router = Router([Backend(A)], make_policy("kv-aware"))
            assert await HealthChecker(router, client).check_all() == 1
            assert router.backend(A).load == BackendLoad(running=5, waiting=7, kv_usage=0.75)

    asyncio.run(scenario())
    assert asked == [list(LOAD_GAUGES)]


def test_slow_or_failing_health_marks_down_after_the_threshold_refused_at_once():
    fake = FakeBackends()
    router = Router([Backend(A), Backend(B)], make_policy("kv-aware"))
    status = {A: 200}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a.test" and request.url.path == "/health":
            return httpx.Response(status[A])
        return fake(request)

    async def scenario() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            checker = HealthChecker(router, client, failure_threshold=3)
            assert await checker.check_all() == 2
            router.index.store(A, [b"h" * 32])
            status[A] = 503
            assert await checker.check(router.backend(A))       # 1st failure: still up
            assert await checker.check(router.backend(A))       # 2nd
            assert not await checker.check(router.backend(A))   # 3rd: down, index dropped
            assert router.index.num_blocks(A) == 0
            status[A] = 200
            assert await checker.check(router.backend(A))       # back when healthy
            fake.healthy[B] = False
            assert not await checker.check(router.backend(B))   # refused: down at once

    asyncio.run(scenario())


def test_body_fields_read_only_the_top_level_fields_the_router_needs():
    from pagedkv.router.proxy import _body_fields, _BodyFields

    body = json.dumps({"prompt": list(range(5000)), "stream": True, "user": "u-1",
                       "model": "tiny", "messages": [{"role": "user", "stream": False}]})
    assert _body_fields(body.encode()) == _BodyFields(stream=True, user="u-1", model="tiny")
    assert _body_fields(b'{"stream": "yes", "user": 3, "model": null}') == _BodyFields()
    assert _body_fields(b'{"stream": true, "stream": false}') == _BodyFields()  # the last wins
    for bad in (b"not json", b"[1, 2]", b"3", b"", b'{"stream": true'):
        assert _body_fields(bad) == _BodyFields(), bad


def test_the_request_id_goes_to_the_backend_and_other_methods_are_405():
    seen: list[str | None] = []
    fake = FakeBackends()

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            seen.append(request.headers.get("x-request-id"))
        return fake(request)

    router = Router([Backend(A)], make_policy("round-robin"))
    app = create_router_app(router, transport=httpx.MockTransport(handler), health_interval_s=60)
    with TestClient(app) as client:
        assert client.post("/v1/completions", json={"prompt": "x"},
                           headers={"X-Request-Id": "req-7"}).status_code == 200
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
        resp = client.get("/v1/completions")
        assert resp.status_code == 405 and resp.json()["error"]["type"] == "method_not_allowed"
    assert seen == ["req-7", None]


def test_health_rounds_fetch_kv_info_and_models_only_every_info_interval():
    fake = FakeBackends()
    router = Router([Backend(A)], make_policy("kv-aware"))

    def count(path: str) -> int:
        return sum(1 for _, p in fake.log if p == path)

    async def scenario() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as client:
            checker = HealthChecker(router, client, info_interval_s=3600)
            for _ in range(3):
                assert await checker.check_all() == 1
            assert [count(p) for p in ("/health", "/metrics", "/kv_cache_info",
                                       "/v1/models")] == [3, 3, 1, 1]
            assert router.backend(A).models == {"tiny", "only-a.test"}
            router.mark_down(router.backend(A), "a request failed")  # perhaps restarted
            assert await checker.check_all() == 1
            assert [count(p) for p in ("/kv_cache_info", "/v1/models")] == [2, 2]

    asyncio.run(scenario())
