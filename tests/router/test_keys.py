"""API keys around the router (issue 20): no backend key is picked up from the server's
$PAGEDKV_API_KEY, a router holding one refuses to start without a client key unless told, and
the router accepts the bearer scheme in any case, with the server's own check."""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

from pagedkv.cli import build_parser
from pagedkv.commands.router import build_router
from pagedkv.http.auth import bearer_key_matches
from pagedkv.router.app import create_router_app
from pagedkv.router.backend import Backend
from pagedkv.router.policies import make_policy
from pagedkv.router.router import Router
from tests.router.test_proxy import FakeBackends, make_app


def parse(*argv: str):
    return build_parser("router").parse_args(["router", "--policy", "round-robin",
                                              "--backend", "http://127.0.0.1:1", *argv])


def test_the_servers_key_variable_is_not_the_routers_backend_key(monkeypatch):
    monkeypatch.setenv("PAGEDKV_API_KEY", "server-secret")
    monkeypatch.delenv("PAGEDKV_ROUTER_BACKEND_API_KEY", raising=False)
    monkeypatch.delenv("PAGEDKV_ROUTER_API_KEY", raising=False)
    args = parse()
    assert args.backend_api_key is None and args.api_key is None
    build_router(args)  # starts: it holds no key to lend
    monkeypatch.setenv("PAGEDKV_ROUTER_BACKEND_API_KEY", "backend-secret")
    assert parse().backend_api_key == "backend-secret"


def test_a_backend_key_without_a_client_key_refuses_to_start_unless_allowed(monkeypatch):
    monkeypatch.delenv("PAGEDKV_ROUTER_API_KEY", raising=False)
    with pytest.raises(ValueError, match="--allow-anonymous-clients"):
        build_router(parse("--backend-api-key", "k"))
    build_router(parse("--backend-api-key", "k", "--api-key", "client"))
    build_router(parse("--backend-api-key", "k", "--allow-anonymous-clients"))
    router = Router([Backend("http://a.test")], make_policy("round-robin"))
    with pytest.raises(ValueError, match="backend API key"):
        create_router_app(router, backend_api_key="k")
    create_router_app(router, backend_api_key="k", allow_anonymous_clients=True)


@pytest.mark.parametrize("argv, message", [
    (["--first-byte-timeout", "0"], "--first-byte-timeout"),
    (["--first-byte-timeout", "inf"], "--first-byte-timeout"),
    (["--connect-timeout", "-1"], "--connect-timeout"),
    (["--eject-seconds", "nan"], "--eject-seconds"),
])
def test_bad_timeouts_are_value_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        build_router(parse(*argv))


@pytest.mark.parametrize("header, ok", [
    ("Bearer sekret", True), ("bearer sekret", True), ("BEARER sekret", True),
    ("Bearer  sekret ", True), ("Bearer wrong", False), ("Basic sekret", False),
    ("sekret", False), ("", False), (None, False)])
def test_one_bearer_check_case_insensitive_scheme(header, ok):
    assert bearer_key_matches(header, "sekret") is ok
    assert bearer_key_matches(header.encode() if header else header, b"sekret") is ok


def test_the_router_accepts_the_scheme_in_any_case_and_sends_the_backend_key():
    seen: list[str | None] = []
    fake = FakeBackends()

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            seen.append(request.headers.get("authorization"))
        return fake(request)

    router = Router([Backend("http://a.test")], make_policy("round-robin"))
    app = create_router_app(router, api_key="sekret", backend_api_key="backend",
                            transport=httpx.MockTransport(handler), health_interval_s=60)
    with TestClient(app) as client:
        for scheme in ("Bearer", "bearer", "BEARER"):
            resp = client.post("/v1/completions", json={"prompt": "x"},
                               headers={"Authorization": f"{scheme} sekret"})
            assert resp.status_code == 200, resp.text
        resp = client.post("/v1/completions", json={"prompt": "x"},
                           headers={"Authorization": "Bearer backend"})
        assert resp.status_code == 401  # the backend's key is not the router's
        assert resp.json()["error"]["code"] == "invalid_api_key"
    assert seen == ["Bearer backend"] * 3
    _, plain = make_app(FakeBackends())
    with TestClient(plain) as client:  # no keys at all: open, as before
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
