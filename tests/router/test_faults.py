"""The router under backend faults, on real loopback sockets (issue 20): a backend that accepts
and never answers costs a bounded wait (the first-byte timeout), is tried once per request and
ejected; a request no backend answers in time is a 504; every relayed stream ends with
data: [DONE]; a non-JSON 200 is a 502. Every wait here is bounded (asyncio.wait_for), and
pytest-timeout's thread method backs that up: nothing can hang CI."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from pagedkv.http.errors import APIError
from pagedkv.router.app import create_router_app
from pagedkv.router.backend import Backend
from pagedkv.router.policies import RouteRequest, make_policy
from pagedkv.router.proxy import Forwarder
from pagedkv.router.router import Router
from tests.router.fake_backend import FakeBackend, ThreadServer
from tests.router.test_proxy import sample

pytestmark = pytest.mark.timeout(60, method="thread")

TIMEOUT_S = 1.0  # the router's first-byte timeout in the tests of timeouts
SLACK_S = 3.0  # what a request may take beyond the timeouts it went through
# The first-byte (and mid-stream idle) timeout, and the health checks' timeout, where a test is
# not about timeouts: a backend slowed by a loaded CI machine must not look wedged there.
PATIENT_S = 30.0
BACKEND_HEADER = "x-pagedkv-backend"


def router_server(*backends: FakeBackend, eject_s: float = 30.0,
                  first_byte_timeout_s: float = PATIENT_S) -> tuple[Router, ThreadServer]:
    """A round-robin router over `backends`, served on a free port. Its first-byte timeout is
    `first_byte_timeout_s`: tests of timeouts pass TIMEOUT_S, the others keep PATIENT_S."""
    router = Router([Backend(b.url) for b in backends], make_policy("round-robin"),
                    eject_s=eject_s)
    app = create_router_app(router, health_interval_s=0.2, health_timeout_s=PATIENT_S,
                            first_byte_timeout_s=first_byte_timeout_s)
    return router, ThreadServer(app, lifespan="on")


async def post_all(url: str, bodies: list[dict]) -> list[tuple[httpx.Response, float]]:
    """POST every body at once; (answer, seconds it took) each. Bounded by wait_for."""
    async with httpx.AsyncClient(timeout=20) as client:
        async def one(body: dict) -> tuple[httpx.Response, float]:
            start = time.monotonic()
            resp = await client.post(url + "/v1/completions", json=body)
            return resp, time.monotonic() - start
        return await asyncio.wait_for(asyncio.gather(*(one(b) for b in bodies)), timeout=30)


def test_a_wedged_backend_costs_one_bounded_wait_per_request_then_is_ejected():
    with FakeBackend("wedged") as wedged, FakeBackend("ok") as good:
        router, server = router_server(wedged, good, first_byte_timeout_s=TIMEOUT_S)
        with server:
            first = asyncio.run(post_all(server.url, [{"prompt": "x", "model": "tiny"}] * 4))
            later = asyncio.run(post_all(server.url, [{"prompt": "y"}] * 4))
            metrics = httpx.get(server.url + "/metrics", timeout=10).text
            for resp, seconds in first + later:
                assert resp.status_code == 200, resp.text
                assert resp.headers[BACKEND_HEADER] == good.url
                assert seconds < TIMEOUT_S + SLACK_S
            # Round-robin sent some of the first burst to the wedged backend: each of those
            # waited one timeout there (one attempt each), then went to the good one.
            assert 1 <= wedged.attempts <= 2
            assert sample(metrics, "pagedkv_router:retries_total", backend=wedged.url,
                          reason="timeout") == wedged.attempts
            assert good.attempts == 8
            # Ejected: the later requests never went there, though its /health says 200.
            assert sample(metrics, "pagedkv_router:backend_ejections_total",
                          backend=wedged.url) == wedged.attempts
            assert router.backend(wedged.url).up and router.backend(wedged.url).ejected(
                time.monotonic())
            assert all(b.in_flight == 0 for b in router.backends)


def test_no_backend_answering_in_time_is_a_504_after_one_attempt_each():
    with FakeBackend("wedged") as a, FakeBackend("wedged") as b:
        router, server = router_server(a, b, first_byte_timeout_s=TIMEOUT_S)
        with server:
            [(resp, seconds)] = asyncio.run(post_all(server.url, [{"prompt": "x"}]))
            assert resp.status_code == 504
            error = resp.json()["error"]
            assert error["type"] == "timeout" and error["code"] == "upstream_timeout"
            assert (a.attempts, b.attempts) == (1, 1)
            assert seconds < 2 * TIMEOUT_S + SLACK_S
            # Both ejected: the next request is refused at once instead of waiting again.
            [(again, seconds)] = asyncio.run(post_all(server.url, [{"prompt": "x"}]))
            assert again.status_code == 503 and seconds < SLACK_S
            assert (a.attempts, b.attempts) == (1, 1)


def test_an_ejection_ends_and_a_recovered_backend_gets_requests_again():
    with FakeBackend("wedged") as flaky, FakeBackend("ok") as good:
        router, server = router_server(flaky, good, eject_s=0.3,
                                       first_byte_timeout_s=TIMEOUT_S)
        with server:
            asyncio.run(post_all(server.url, [{"prompt": "x"}] * 2))
            assert flaky.attempts == 1
            flaky.mode = "ok"
            time.sleep(0.4)
            answers = asyncio.run(post_all(server.url, [{"prompt": "x"}] * 4))
            assert {r.headers[BACKEND_HEADER] for r, _ in answers} == {flaky.url, good.url}
            assert router.backend(flaky.url).consecutive_failures == 0


def sse_events(text: str) -> list[str]:
    return [e for e in text.split("\n\n") if e.strip()]


def test_every_relayed_stream_ends_with_done():
    with FakeBackend("no_done") as cut, FakeBackend("ok") as good:
        router, server = router_server(cut, good)
        with server, httpx.Client(timeout=20) as client:
            for _ in range(2):  # round-robin: one stream from each
                resp = client.post(server.url + "/v1/completions",
                                   json={"prompt": "x", "stream": True})
                assert resp.status_code == 200
                events = sse_events(resp.text)
                assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
                if resp.headers[BACKEND_HEADER] == good.url:
                    assert events[:-1] == ['data: {"choices":[{"text":"a"}]}',
                                           'data: {"choices":[{"text":"b"}]}']
                else:  # cut mid-event: the cut event is closed, then an error event
                    assert events[0] == 'data: {"choices":[{"text":"a"}]}'
                    assert events[1] == 'data: {"choices":[{"te'
                    error = json.loads(events[2][len("data: "):])["error"]
                    assert "without data: [DONE]" in error["message"]
            metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert sample(metrics, "pagedkv_router:stream_errors_total", backend=cut.url) == 1
        assert cut.attempts == good.attempts == 1


def test_a_non_json_200_is_retried_and_a_502_when_no_backend_does_better():
    with FakeBackend("not_json") as bad, FakeBackend("ok") as good:
        router, server = router_server(bad, good)
        with server:
            answers = asyncio.run(post_all(server.url, [{"prompt": "x"}] * 2))
            assert [r.status_code for r, _ in answers] == [200, 200]
            assert all(r.headers[BACKEND_HEADER] == good.url for r, _ in answers)
            assert bad.attempts == 1 and router.backend(bad.url).ejected(time.monotonic())
    with FakeBackend("not_json") as bad1, FakeBackend("not_json") as bad2:
        _, server = router_server(bad1, bad2)
        with server:
            [(resp, _)] = asyncio.run(post_all(server.url, [{"prompt": "x"}]))
            assert resp.status_code == 502
            assert resp.json()["error"]["code"] == "invalid_upstream_response"
            assert (bad1.attempts, bad2.attempts) == (1, 1)


@pytest.mark.parametrize("modes", [("500", "500", "500"), ("500", "wedged", "refuse"),
                                   ("wedged", "500", "500")])
def test_each_failing_backend_gets_exactly_one_attempt(modes):
    """A retry never goes back to a backend that already failed this request (a 5xx, which
    neither marks down nor ejects, included): one attempt each, then the last failure."""
    urls = [f"http://b{i}.test" for i in range(len(modes))]
    attempts = dict.fromkeys(urls, 0)
    order: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0)  # a real suspension point, so wait_for can always cancel
        base = f"http://{request.url.host}"
        attempts[base] += 1
        order.append(base)
        mode = modes[urls.index(base)]
        if mode == "wedged":
            await asyncio.sleep(3600)
        if mode == "refuse":
            raise httpx.ConnectError("refused")
        return httpx.Response(500, json={"error": {"message": "boom"}})

    async def scenario() -> int:
        router = Router([Backend(u, up=True) for u in urls], make_policy("round-robin"))
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            forwarder = Forwarder(router, client, first_byte_timeout_s=0.2)
            answer = await asyncio.wait_for(forwarder._place(
                RouteRequest(), "/v1/completions", b'{"prompt": "x"}', False), timeout=5)
        assert all(b.in_flight == 0 for b in router.backends)
        return answer.status_code

    try:
        status = asyncio.run(scenario())
    except APIError as exc:  # the last backend refused: nothing to relay
        status = exc.status_code
    assert attempts == dict.fromkeys(urls, 1)
    last_mode = modes[urls.index(order[-1])]  # the answer is the last failure's
    assert status == {"500": 500, "refuse": 503, "wedged": 504}[last_mode]


def test_a_stream_gone_silent_ends_in_bounded_time_with_an_error_and_done():
    with FakeBackend("stall") as silent, FakeBackend("json") as plain:
        router, server = router_server(silent, plain, first_byte_timeout_s=TIMEOUT_S)
        with server, httpx.Client(timeout=20) as client:
            start = time.monotonic()
            resp = client.post(server.url + "/v1/completions",
                               json={"prompt": "x", "stream": True})
            seconds = time.monotonic() - start
            assert resp.headers[BACKEND_HEADER] == silent.url  # round-robin: first
            events = sse_events(resp.text)
            assert events[0] == 'data: {"choices":[{"text":"a"}]}'
            assert "sent nothing" in json.loads(events[1][len("data: "):])["error"]["message"]
            assert events[2:] == ["data: [DONE]"]
            assert seconds < TIMEOUT_S + SLACK_S
            assert router.backend(silent.url).ejected(time.monotonic())
            # A stream request answered with plain JSON is relayed whole, as JSON.
            resp = client.post(server.url + "/v1/completions",
                               json={"prompt": "x", "stream": True})
            assert resp.headers[BACKEND_HEADER] == plain.url
            assert resp.json()["choices"][0]["text"] == f"from {plain.url}"


def test_a_client_gone_from_a_silent_stream_closes_it_at_once_on_the_backend():
    """No chunk flows on a stalled stream, so nothing would notice the client going but the
    router's watcher: it cancels the relay, which closes the upstream connection."""
    with FakeBackend("stall") as silent:
        router, server = router_server(silent)
        with server:
            with httpx.stream("POST", server.url + "/v1/completions", timeout=20,
                              json={"prompt": "x", "stream": True}) as resp:
                assert next(resp.iter_raw()).startswith(b'data: {"choices"')
            deadline = time.monotonic() + 5
            while silent.aborted == 0 or router.backend(silent.url).in_flight:
                assert time.monotonic() < deadline, "the backend's stream was never closed"
                time.sleep(0.02)
            assert silent.aborted == 1
            metrics = httpx.get(server.url + "/metrics", timeout=10).text
            assert sample(metrics, "pagedkv_router:stream_errors_total", backend=silent.url) == 0
