"""The router's /dashboard (issue 23): the fleet page, and /dashboard/fleet's backends (load and
KV usage from their /metrics) and recent routing decisions with each candidate's score."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from pagedkv.router.decisions import RoutingDecisions
from pagedkv.router.policies import make_policy
from pagedkv.router.policies.base import Candidate, RouteRequest
from pagedkv.router.policies.kv_aware import KVAwarePolicy, cost
from pagedkv.router.prefix_index import PrefixMatch
from tests.router.test_proxy import A, B, FakeBackends, make_app


def test_fleet_page_and_json_after_routing():
    fake = FakeBackends()
    router, app = make_app(fake)
    with TestClient(app) as client:
        page = client.get("/dashboard")
        assert page.status_code == 200 and 'id="backends"' in page.text
        assert "https://" not in page.text
        assert "poll" in client.get("/dashboard/static/fleet.js").text
        for i in range(4):
            r = client.post("/v1/completions", json={"model": "tiny", "prompt": f"p{i}"})
            assert r.status_code == 200
        fleet = client.get("/dashboard/fleet").json()
    assert fleet["policy"] == "round-robin" and fleet["decisions_total"] == 4
    assert [d["chosen"] for d in fleet["decisions"]] == [A, B, A, B]
    assert all(c["score"] is None for d in fleet["decisions"] for c in d["candidates"])
    by_name = {b["name"]: b for b in fleet["backends"]}
    assert by_name[A]["up"] and by_name[A]["kv_usage"] == 0.25 and by_name[A]["running"] == 2
    assert by_name[A]["num_gpu_blocks"] == 64 and by_name[A]["in_flight"] == 0


def test_kv_aware_decisions_carry_each_candidates_cost():
    policy = KVAwarePolicy()
    request = RouteRequest(prompt_tokens=40, block_hashes=tuple(bytes([i]) * 16 for i in range(10)),
                           session="tenant-a")
    candidates = [Candidate(name=A, in_flight=1, match=PrefixMatch(device_blocks=8)),
                  Candidate(name=B, in_flight=0)]
    chosen = policy.choose(request, candidates)
    decisions = RoutingDecisions(capacity=2)
    for _ in range(3):
        decisions.record(policy, request, candidates, chosen)
    assert decisions.total == 3 and len(decisions.records) == 2  # bounded
    record = decisions.records[-1]
    assert record["chosen"] == A and record["prefix"] == (bytes([0]) * 8).hex()
    assert [c["score"] for c in record["candidates"]] == pytest.approx([
        cost(request, c, policy.weights) for c in candidates])
    assert record["candidates"][0]["score"] < record["candidates"][1]["score"]
    assert make_policy("round-robin").name == "round-robin"


def test_with_an_api_key_the_fleet_needs_the_key_or_a_session():
    router, app = make_app(FakeBackends(), api_key="sekrit")
    with TestClient(app) as client:
        assert client.get("/dashboard").status_code == 200  # the page: no data
        denied = client.get("/dashboard/fleet")
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        assert client.post("/dashboard/session",
                           headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get("/dashboard/fleet",
                          headers={"Authorization": "Bearer sekrit"}).status_code == 200
        opened = client.post("/dashboard/session", headers={"Authorization": "Bearer sekrit"})
        assert opened.status_code == 200 and "httponly" in opened.headers["set-cookie"].lower()
        assert client.get("/dashboard/fleet").json()["policy"] == "round-robin"  # the cookie
        client.delete("/dashboard/session")
        assert client.get("/dashboard/fleet").status_code == 401
