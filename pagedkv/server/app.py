"""The OpenAI-compatible FastAPI app: `create_app(engine, served_model_name=...)`.

Routes (server/routes/, one APIRouter each): POST /v1/completions, POST /v1/chat/completions,
POST /v1/responses, GET /v1/models, GET /v1/models/{id}, GET /health, GET|POST /ping, GET /metrics
(Prometheus text), GET /version, vLLM's POST /tokenize and POST /detokenize, pagedkv's POST /v1/pin
and /v1/unpin (pinned prefixes), GET /kv_cache_info (block size, hash algorithm and pool size, for
`pagedkv router`), and the live dashboard: GET /dashboard and POST /v1/cache/explain
(server/dashboard/). With `api_key`, every route that does work for a client (every /v1 route,
/tokenize, /detokenize) needs `Authorization: Bearer <api_key>` (401 otherwise; the scheme is
case-insensitive); /health, /ping, /version, /metrics, /kv_cache_info and the dashboard's page
stay open, its data (/dashboard/events, /dashboard/api/*) needs the key or a dashboard session
cookie (pagedkv/http/dashboard_access.py). A request body over `max_request_bytes` is a 413.
Errors are OpenAI-style bodies (pagedkv/http/errors.py).

The app owns an `AsyncEngine` (the engine's step loop in one background thread), started and
stopped by the app's lifespan; everything lives on `app.state` (the routes read it there),
nothing in module globals, so several apps (engines) can share a process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedkv import __version__
from pagedkv.engine.async_engine import AsyncEngine
from pagedkv.http.auth import invalid_api_key
from pagedkv.http.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimitMiddleware
from pagedkv.http.dashboard_access import DATA_PREFIXES, DashboardAccess
from pagedkv.http.errors import error_response, install_error_handlers
from pagedkv.server.dashboard.routes import make_dashboard_router
from pagedkv.server.engine_facts import engine_facts
from pagedkv.server.fingerprint import system_fingerprint
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.routes import health, openai, ops, pins, tokens
from pagedkv.server.serving import OpenAIServing
from pagedkv.server.tool_parsers import get_tool_parser
from pagedkv.server.vllm_metrics import cache_config_info

if TYPE_CHECKING:
    from pagedkv.engine.llm_engine import LLMEngine

DEFAULT_MAX_PENDING = 4096
DEFAULT_STALL_TIMEOUT_S = 120.0  # a loop round (one step) longer than this: /health is 503


def create_app(engine: LLMEngine, *, served_model_name: str, api_key: str | None = None,
               max_pending: int = DEFAULT_MAX_PENDING,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               tool_call_parser: str | None = None,
               on_engine_dead: Callable[[str], None] | None = None,
               stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
               strict_request_fields: bool = False,
               on_ready: Callable[[], None] | None = None) -> FastAPI:
    """An app serving `engine` (an `LLMEngine`) as `served_model_name`. `tool_call_parser`
    (a name in `pagedkv.server.tool_parsers.TOOL_PARSERS`) enables `tool_choice: "auto"`.
    /health answers 503 while the engine loop has spent more than `stall_timeout_s` in one
    round (one step): a wedged engine, though its thread lives (a router then stops sending).
    `strict_request_fields`: a request field no API of ours defines is a 400 (default: ignored
    with a logged warning, as vLLM does).

    The engine's loop thread starts with the app's lifespan (uvicorn, or `with TestClient(app)`)
    and is joined when it ends; requests in flight are aborted then. `on_engine_dead(reason)`
    is called (from the loop thread) when the engine loop cannot go on; `pagedkv serve` stops
    the process then. `app.state.async_engine.begin_drain()` / `end_remaining()` drain it.
    `on_ready()` is called once the loop runs, before the app takes requests (`pagedkv
    serve` logs its start-up banner there).
    """
    _check_settings(served_model_name, max_request_bytes, stall_timeout_s)
    tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
    facts = engine_facts(engine)
    async_engine = AsyncEngine(engine, max_pending=max_pending, on_fatal=on_engine_dead)
    metrics = ServerMetrics(served_model_name, max_model_len=facts.ready.max_model_len,
                            block_size=facts.args.block_size, cache_info=cache_config_info(facts))
    serving = OpenAIServing(async_engine, model_name=served_model_name, metrics=metrics,
                            tool_parser=tool_parser, strict_request_fields=strict_request_fields,
                            system_fingerprint=system_fingerprint(facts))

    app = FastAPI(title="pagedkv", version=__version__, lifespan=_lifespan,
                  description="OpenAI-compatible API of a paged-KV-cache LLM engine")
    app.state.async_engine, app.state.serving, app.state.metrics = async_engine, serving, metrics
    app.state.engine_facts, app.state.stall_timeout_s = facts, stall_timeout_s
    app.state.on_ready = on_ready
    install_error_handlers(app)
    access = DashboardAccess(api_key)
    if api_key:
        _install_api_key(app, access)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_bytes)
    for routes in (health.router, tokens.router, ops.router, openai.router, pins.router):
        app.include_router(routes)
    app.include_router(make_dashboard_router(async_engine, serving, metrics, served_model_name,
                                             access))
    return app


def _check_settings(served_model_name: str, max_request_bytes: int,
                    stall_timeout_s: float) -> None:
    if not served_model_name:
        raise ValueError(f"served_model_name must be a non-empty string, got {served_model_name!r}")
    if not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be a positive integer, got {max_request_bytes!r}")
    if not stall_timeout_s > 0:
        raise ValueError(f"stall_timeout_s must be positive, got {stall_timeout_s!r}")


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The engine loop runs while the app does; requests in flight are aborted at its end."""
    app.state.async_engine.start()
    try:
        if app.state.on_ready is not None:
            app.state.on_ready()
        yield
    finally:
        app.state.async_engine.shutdown()
        app.state.serving.close()


# Routes that do work for a client: they need the API key when the server has one.
PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize")


def _install_api_key(app: FastAPI, access: DashboardAccess) -> None:
    """Every route under PROTECTED_PREFIXES answers 401 unless `Authorization: Bearer
    <api_key>` is sent; the dashboard's data routes also take a session cookie."""
    app.add_middleware(_APIKeyMiddleware, access=access)


class _APIKeyMiddleware:
    """A plain ASGI middleware (no response buffering, so streaming and disconnects pass)."""

    def __init__(self, app: ASGIApp, access: DashboardAccess) -> None:
        self.app = app
        self.access = access

    def _authorized(self, path: str, headers: dict[bytes, bytes]) -> bool:
        if path.startswith(PROTECTED_PREFIXES):
            return self.access.key_matches(headers.get(b"authorization", b""))
        if path.startswith(DATA_PREFIXES):
            return self.access.allows(headers.get(b"authorization"), headers.get(b"cookie"))
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._authorized(
                scope["path"], dict(scope.get("headers") or [])):
            response = error_response(invalid_api_key())
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
