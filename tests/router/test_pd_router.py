"""The router in prefill/decode mode against a fake fleet (pd_fakes.py): the exact two-hop
wire (vLLM's), streaming passthrough, bounded fallbacks that lose nothing, and the choice of
each hop's instance."""

from __future__ import annotations

import time

import httpx
import pytest
from fastapi.testclient import TestClient

from pagedkv.router.app import create_router_app
from pagedkv.router.health import HealthChecker
from pagedkv.router.pd import PDMode, pd_backends
from pagedkv.router.pd_wire import REMOTE_DECODE
from pagedkv.router.policies import make_policy
from pagedkv.router.router import Router
from pagedkv.router.upstream import HttpxUpstream
from tests.router.pd_fakes import D1, D2, P1, P2, STREAM_CHUNKS, PDFleet, gauges, producer_params
from tests.router.test_proxy import sample

pytestmark = pytest.mark.timeout(60, method="thread")

PREFILLS, DECODES = (P1, P2), (D1, D2)


def pd_app(fleet: PDFleet, *, prefill_timeout_s: float = 5.0, policy: str = "kv-aware",
           prefills=PREFILLS, decodes=DECODES):
    router = Router(pd_backends(prefills, decodes), make_policy(policy))
    pd = PDMode(router, prefill_timeout_s=prefill_timeout_s)
    app = create_router_app(router, transport=httpx.MockTransport(fleet),
                            health_interval_s=60, pd=pd)
    return router, app


def assert_books_closed(router: Router) -> None:
    assert all(b.in_flight == 0 and b.queued_blocks == 0 for b in router.backends)


def test_completion_runs_the_exact_two_hop_wire():
    fleet = PDFleet()
    router, app = pd_app(fleet)
    request = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 7,
               "temperature": 0, "stream": False, "logprobs": 1}
    with TestClient(app) as client:
        resp = client.post("/v1/completions", json=request)
        metrics = client.get("/metrics").text
    assert resp.status_code == 200
    prefill, decode = fleet.hops
    assert prefill.host in PREFILLS and decode.host in DECODES
    assert prefill.path == decode.path == "/v1/completions"
    assert prefill.body == {**request, "max_tokens": 1, "stream": False,
                            "kv_transfer_params": REMOTE_DECODE}
    assert prefill.body["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert decode.body == {**request, "kv_transfer_params": producer_params(prefill.host)}
    assert resp.json()["served_by"] == decode.host and resp.json()["got"] == decode.body
    assert resp.headers["x-pagedkv-backend"] == decode.host
    rid = prefill.headers["x-request-id"]  # one id for both hops, as vLLM's proxy sends
    assert rid and decode.headers["x-request-id"] == rid
    assert sample(metrics, "pagedkv_router:pd_prefill_requests_total", backend=prefill.host,
                  outcome="ok") == 1
    assert sample(metrics, "pagedkv_router:pd_decode_requests_total", backend=decode.host,
                  transfer="yes") == 1
    assert sample(metrics, "pagedkv_router:pd_prefill_seconds_count",
                  backend=prefill.host) == 1
    assert "pagedkv_router:pd_fallbacks_total{" not in metrics
    assert_books_closed(router)


def test_chat_stream_is_relayed_and_the_client_request_id_kept():
    fleet = PDFleet()
    router, app = pd_app(fleet)
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi there"}],
               "max_completion_tokens": 20, "stream": True,
               "stream_options": {"include_usage": True}, "min_tokens": 3}
    with TestClient(app) as client:
        resp = client.post("/v1/chat/completions", json=request,
                           headers={"x-request-id": "client-7"})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.content == b"".join(STREAM_CHUNKS)
    prefill, decode = fleet.hops
    expected = {k: v for k, v in request.items() if k not in ("stream_options", "min_tokens")}
    assert prefill.body == {**expected, "max_tokens": 1, "max_completion_tokens": 1,
                            "stream": False, "kv_transfer_params": REMOTE_DECODE}
    assert decode.body == {**request, "kv_transfer_params": producer_params(prefill.host)}
    assert prefill.headers["x-request-id"] == decode.headers["x-request-id"] == "client-7"
    assert_books_closed(router)


@pytest.mark.parametrize("mode, reason", [
    ("500", "status_500"), ("refuse", "connect"), ("slow", "timeout"),
    ("plain", "no_params"), ("garbage", "no_params")])
@pytest.mark.parametrize("stream", [False, True])
def test_a_prefill_that_does_not_deliver_falls_back_to_a_normal_decode(mode, reason, stream):
    fleet = PDFleet(prefill={P1: mode})
    router, app = pd_app(fleet, prefill_timeout_s=0.3, prefills=(P1,))
    request = {"model": "tiny", "prompt": "abc", "max_tokens": 5, "stream": stream}
    with TestClient(app) as client:
        started = time.monotonic()
        resp = client.post("/v1/completions", json=request)
        elapsed = time.monotonic() - started
        metrics = client.get("/metrics").text
    assert resp.status_code == 200
    assert elapsed < 3.0  # bounded: the slow prefill is abandoned at 0.3 s
    decodes = fleet.posts(DECODES)
    assert len(decodes) == 1 and decodes[0].body == request  # the client's request, untouched
    if stream:
        assert resp.content == b"".join(STREAM_CHUNKS)
    else:
        assert resp.json()["got"] == request
    assert sample(metrics, "pagedkv_router:pd_fallbacks_total", reason=reason) == 1
    assert sample(metrics, "pagedkv_router:pd_decode_requests_total",
                  backend=decodes[0].host, transfer="no") == 1
    assert sample(metrics, "pagedkv_router:pd_prefill_requests_total", backend=P1,
                  outcome=reason) == 1
    assert_books_closed(router)
    assert router.backend(P1).up == (mode != "refuse")
    assert router.backend(P1).ejected(time.monotonic()) == (mode == "slow")


def test_with_every_prefill_instance_down_requests_still_decode():
    fleet = PDFleet(prefill={P1: "refuse", P2: "refuse"})
    router, app = pd_app(fleet)
    with TestClient(app) as client:
        answers = [client.post("/v1/completions", json={"prompt": f"p{i}", "max_tokens": 2})
                   for i in range(4)]
        metrics = client.get("/metrics").text
    assert [a.status_code for a in answers] == [200] * 4
    assert len(fleet.posts(PREFILLS)) == 2  # each refused once, then marked down
    assert len(fleet.posts(DECODES)) == 4
    assert sample(metrics, "pagedkv_router:pd_fallbacks_total", reason="connect") == 2
    assert sample(metrics, "pagedkv_router:pd_fallbacks_total",
                  reason="no_prefill_instance") == 2
    assert_books_closed(router)


def test_responses_and_non_json_bodies_go_to_a_decode_instance():
    fleet = PDFleet()
    router, app = pd_app(fleet)
    with TestClient(app) as client:
        assert client.post("/v1/responses", json={"input": "hi"}).status_code == 200
        client.post("/v1/completions", content=b"[1, 2]",
                    headers={"content-type": "application/json"})
    assert [h.host in DECODES for h in fleet.hops] == [True, True]
    assert fleet.posts(PREFILLS) == []


def test_prefill_goes_where_the_prefix_is_and_away_from_load():
    """kv-aware over the prefill set: a repeated prompt returns to the instance that
    prefilled it (the router's record of its blocks); a cold prompt avoids a loaded one."""
    fleet = PDFleet()
    router, app = pd_app(fleet)
    long_prompt = "shared system prompt, long enough for several blocks " * 2
    with TestClient(app) as client:
        for _ in range(3):
            client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 2})
        fleet.metrics[P1] = gauges(running=40)
        fleet.metrics[P2] = gauges(running=0)
        health_round(router, fleet, client)
        for i in range(3):
            client.post("/v1/completions", json={"prompt": f"cold {i} " * 8, "max_tokens": 2})
    prefills = [h.host for h in fleet.posts(PREFILLS)]
    assert len(set(prefills[:3])) == 1  # the warm prompt stayed on one instance
    assert prefills[3:] == [P2, P2, P2]  # cold ones avoided the loaded one
    assert router.decisions.total == 12  # 6 prefill + 6 decode placements


def health_round(router: Router, fleet: PDFleet, client: TestClient) -> None:
    """One health round now, on the app's loop (its checker runs every 60 s in these tests)."""
    async def round_() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(fleet)) as http:
            await HealthChecker(router, HttpxUpstream(http)).check_all()

    client.portal.call(round_)


def test_decode_goes_by_load_and_kv_room():
    fleet = PDFleet(metrics={D1: gauges(running=0, kv_usage=0.97),  # idle but full
                             D2: gauges(running=10, kv_usage=0.2)})
    router, app = pd_app(fleet)
    with TestClient(app) as client:
        client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        fleet.metrics[D1] = gauges(running=0, kv_usage=0.1)
        health_round(router, fleet, client)
        client.post("/v1/completions", json={"prompt": "b", "max_tokens": 2})
    assert [h.host for h in fleet.posts(DECODES)] == [D2, D1]


def test_health_needs_a_decode_instance_and_the_fleet_view_shows_roles():
    fleet = PDFleet(down={D1, D2})
    router, app = pd_app(fleet)
    with TestClient(app) as client:
        assert router.backend(P1).up and not router.backend(D1).up
        assert client.get("/health").status_code == 503  # prefill alone serves nothing
        fleet.down.clear()
        health_round(router, fleet, client)
        assert client.get("/health").status_code == 200
        roles = {b["name"]: b["role"] for b in client.get("/dashboard/fleet").json()["backends"]}
    assert roles == {P1: "prefill", P2: "prefill", D1: "decode", D2: "decode"}
