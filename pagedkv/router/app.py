"""The router's FastAPI app: `create_router_app(router, ...)`.

Routes: POST /v1/completions and /v1/chat/completions (forwarded, proxy.py), GET /v1/models
(the union of the up backends' models), GET /health (200 while a backend is up, else 503),
GET /metrics (the router's own, metrics.py). With `api_key`, the /v1 routes need
`Authorization: Bearer <api_key>`. The lifespan owns the HTTP client, the health checker and
the KV-event subscribers; one health round completes before the first request is served.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pydantic
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import Response

from pagedkv import __version__
from pagedkv.router.health import HealthChecker
from pagedkv.router.kv_events import KVEventSubscriber
from pagedkv.router.proxy import Forwarder
from pagedkv.router.router import Router
from pagedkv.server.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimitMiddleware
from pagedkv.server.errors import APIError, install_error_handlers
from pagedkv.server.protocol import ModelCard, ModelList

CONNECT_TIMEOUT_S = 2.0


def create_router_app(router: Router, *, api_key: str | None = None,
                      backend_api_key: str | None = None, health_interval_s: float = 1.0,
                      health_timeout_s: float = 2.0,
                      max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                      transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """An app that forwards to `router`'s backends. Its background tasks start and stop with
    the app's lifespan (uvicorn, or `with TestClient(app)`). A body over `max_request_bytes`
    is a 413, as on the server. `transport` replaces the network (tests hand in an
    `httpx.MockTransport`)."""
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
        async with httpx.AsyncClient(limits=limits, timeout=timeout,
                                     transport=transport) as client:
            checker = HealthChecker(router, client, interval_s=health_interval_s,
                                    timeout_s=health_timeout_s)
            state["forwarder"] = Forwarder(router, client, backend_api_key=backend_api_key)
            state["client"] = client
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

    app = FastAPI(title="pagedkv router", version=__version__, lifespan=lifespan,
                  description="KV-cache-aware router in front of pagedkv servers")
    app.state.router = router
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_bytes)

    def check_key(raw: Request) -> None:
        if api_key and not hmac.compare_digest(
                raw.headers.get("authorization", "").encode(), f"Bearer {api_key}".encode()):
            raise APIError("Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           status_code=401, type="authentication_error", code="invalid_api_key")

    @app.get("/health")
    async def health() -> Response:
        if not any(b.up for b in router.backends):
            raise APIError("no backend is up", status_code=503, type="server_unavailable")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type=router.metrics.content_type)

    @app.get("/v1/models", response_model=ModelList)
    async def models(raw: Request) -> ModelList:
        check_key(raw)
        return await _merged_models(router, state["client"], state["forwarder"].headers)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        check_key(raw)
        return await state["forwarder"].forward(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        check_key(raw)
        return await state["forwarder"].forward(raw, "/v1/chat/completions")

    return app


async def _merged_models(router: Router, client: httpx.AsyncClient,
                         headers: dict[str, str]) -> ModelList:
    """The models of every up backend, each id once (the first backend's card wins)."""
    async def one(url: str) -> list[dict[str, Any]]:
        try:
            resp = await client.get(url + "/v1/models", headers=headers, timeout=5.0)
            resp.raise_for_status()
            return list(resp.json().get("data") or [])
        except (httpx.HTTPError, ValueError, AttributeError):
            return []

    cards: dict[str, ModelCard] = {}
    for data in await asyncio.gather(*(one(b.url) for b in router.backends if b.up)):
        for raw in data:
            try:
                card = ModelCard.model_validate(raw)
            except pydantic.ValidationError:
                continue  # a card we cannot read is left out, not a 500
            cards.setdefault(card.id, card)
    return ModelList(data=list(cards.values()))
