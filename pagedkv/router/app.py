"""The router's FastAPI app: `create_router_app(router, ...)`.

Routes: POST /v1/completions, /v1/chat/completions and /v1/responses (forwarded, proxy.py, by
a plain ASGI middleware ahead of FastAPI's routing: forward_app.py; a Responses body is placed by
load alone), GET /v1/models
(the union of the up backends' models, as the health checks last read them), GET /health (200
while a backend is up, else 503), GET /metrics (the router's own, metrics.py), GET /dashboard (the
fleet, dashboard.py). With `api_key`,
the /v1 routes need `Authorization: Bearer <api_key>` (the check the server makes too,
`pagedkv.http.auth`). A router holding a `backend_api_key` refuses to be built without an
`api_key` unless `allow_anonymous_clients` says so: it would lend its key to anyone. The
lifespan owns the HTTP client (/tokenize), the upstream of the forwarded requests and of the
health checks (raw_upstream.py; `transport` given: the client's), the health checker and the KV-event
subscribers; one health round completes before the first request is served.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import Response

from pagedkv import __version__
from pagedkv.http.auth import bearer_key_matches, invalid_api_key
from pagedkv.http.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimitMiddleware
from pagedkv.http.dashboard_access import DashboardAccess
from pagedkv.http.errors import APIError, install_error_handlers
from pagedkv.http.protocol import ModelCard, ModelList
from pagedkv.router.dashboard import make_router_dashboard
from pagedkv.router.forward_app import ForwardRoutes
from pagedkv.router.health import HealthChecker
from pagedkv.router.kv_events import KVEventSubscriber
from pagedkv.router.pd import PDForwarder, PDMode
from pagedkv.router.proxy import DEFAULT_FIRST_BYTE_TIMEOUT_S, Forwarder
from pagedkv.router.raw_upstream import RawUpstream
from pagedkv.router.router import Router
from pagedkv.router.upstream import HttpxUpstream, Upstream

DEFAULT_CONNECT_TIMEOUT_S = 2.0
FORWARDED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


def create_router_app(router: Router, *, api_key: str | None = None,
                      backend_api_key: str | None = None, health_interval_s: float = 1.0,
                      health_timeout_s: float = 2.0,
                      max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                      first_byte_timeout_s: float = DEFAULT_FIRST_BYTE_TIMEOUT_S,
                      connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                      allow_anonymous_clients: bool = False,
                      transport: httpx.AsyncBaseTransport | None = None,
                      pd: PDMode | None = None) -> FastAPI:
    """An app that forwards to `router`'s backends. Its background tasks start and stop with
    the app's lifespan (uvicorn, or `with TestClient(app)`). A body over `max_request_bytes`
    is a 413, as on the server. A backend that sends no first byte within
    `first_byte_timeout_s` (or accepts no connection within `connect_timeout_s`) fails that
    attempt (proxy.py). ValueError when `backend_api_key` is given without `api_key` and
    without `allow_anonymous_clients`. `transport` replaces the network (tests hand in an
    `httpx.MockTransport`). `pd`: the prefill/decode split over `router`'s backends (pd.py):
    completions then run a prefill hop and a decode hop."""
    if backend_api_key and not api_key and not allow_anonymous_clients:
        raise ValueError("the router holds a backend API key but clients need none: give the "
                         "router its own --api-key, or --allow-anonymous-clients to lend the "
                         "backend key to anyone who can reach the router")
    for name, value in (("first_byte_timeout_s", first_byte_timeout_s),
                        ("connect_timeout_s", connect_timeout_s)):
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value!r}")
    state: dict[str, Any] = {}
    backend_headers = Forwarder.auth_headers(backend_api_key)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(None, connect=connect_timeout_s)
        async with httpx.AsyncClient(limits=limits, timeout=timeout,
                                     transport=transport) as client:
            upstream: Upstream = (HttpxUpstream(client) if transport is not None else
                                  RawUpstream(connect_timeout_s=connect_timeout_s))
            checker = HealthChecker(router, upstream, interval_s=health_interval_s,
                                    timeout_s=health_timeout_s, headers=backend_headers)
            forwarding: dict[str, Any] = dict(upstream=upstream, backend_api_key=backend_api_key,
                                              first_byte_timeout_s=first_byte_timeout_s)
            state["forwarder"] = (Forwarder(router, client, **forwarding) if pd is None
                                  else PDForwarder(router, client, pd, **forwarding))
            zmq_context = zmq.asyncio.Context()
            await checker.check_all()
            tasks = [asyncio.create_task(checker.run())]
            tasks += [asyncio.create_task(KVEventSubscriber(router, b, zmq_context).run())
                      for b in router.backends if b.events_endpoint]
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                for task in tasks:
                    with contextlib.suppress(BaseException):
                        await task
                zmq_context.term()
                await upstream.aclose()

    app = FastAPI(title="pagedkv router", version=__version__, lifespan=lifespan,
                  description="KV-cache-aware router in front of pagedkv servers")
    app.state.router = router
    install_error_handlers(app)
    app.add_middleware(ForwardRoutes, paths=FORWARDED_PATHS, api_key=api_key,
                       forwarder=lambda: state["forwarder"])
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_bytes)  # outermost

    def check_key(raw: Request) -> None:
        if api_key and not bearer_key_matches(raw.headers.get("authorization"), api_key):
            raise invalid_api_key()

    @app.get("/health")
    async def health() -> Response:  # in prefill/decode mode a decode instance must be up
        if not any(b.up for b in router.backends if pd is None or b.name in pd.decode):
            raise APIError("no backend is up" if pd is None else "no decode instance is up",
                           status_code=503, type="server_unavailable")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type=router.metrics.content_type)

    @app.get("/v1/models", response_model=ModelList)
    async def models(raw: Request) -> ModelList:
        check_key(raw)
        return merged_models(router)

    app.include_router(make_router_dashboard(router, DashboardAccess(api_key)))
    return app


def merged_models(router: Router) -> ModelList:
    """The models of every up backend, each id once (the first backend's card wins)."""
    cards: dict[str, ModelCard] = {}
    for backend in router.backends:
        if backend.up:
            for card in backend.model_cards or ():
                cards.setdefault(card.id, card)
    return ModelList(data=list(cards.values()))
