"""The OpenAI-compatible FastAPI app: `create_app(engine, served_model_name=...)`.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, GET /v1/models,
GET /v1/models/{id}, GET /health, GET|POST /ping, GET /metrics (Prometheus text), GET /version, vLLM's
POST /tokenize and POST /detokenize, pagedkv's POST /v1/pin and /v1/unpin (pinned prefixes),
GET /kv_cache_info (block size, hash algorithm and pool
size, for `pagedkv router`), and the live dashboard: GET /dashboard and POST /v1/cache/explain
(server/dashboard/). With `api_key`, every route that does work for a client (every /v1 route,
/tokenize, /detokenize) needs `Authorization: Bearer <api_key>` (401 otherwise; the scheme is
case-insensitive); /health, /ping, /version, /metrics, /kv_cache_info and the dashboard's page
stay open, its data (/dashboard/events, /dashboard/api/*) needs the key or a dashboard session
cookie (server/dashboard/access.py). A request
body over `max_request_bytes` is a 413. Errors are OpenAI-style bodies (errors.py).

The app owns an `AsyncEngine` (the engine's step loop in one background thread), started and
stopped by the app's lifespan; everything lives on `app.state`, nothing in module globals, so
several apps (engines) can share a process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedkv import __version__
from pagedkv.engine.async_engine import AsyncEngine, EngineDeadError
from pagedkv.http.auth import invalid_api_key
from pagedkv.http.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimitMiddleware
from pagedkv.http.dashboard_access import DATA_PREFIXES, DashboardAccess
from pagedkv.http.errors import APIError, error_response, install_error_handlers
from pagedkv.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    PinRequest,
    PinResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from pagedkv.server.dashboard.routes import make_dashboard_router
from pagedkv.server.fingerprint import system_fingerprint
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.responses_protocol import ResponsesRequest
from pagedkv.server.serving import OpenAIServing
from pagedkv.server.serving_chat import create_chat_completion
from pagedkv.server.serving_completion import create_completion
from pagedkv.server.serving_pins import pin
from pagedkv.server.serving_responses import create_response
from pagedkv.server.serving_tokens import detokenize, tokenize
from pagedkv.server.tool_parsers import get_tool_parser
from pagedkv.server.vllm_metrics import cache_config_info

DEFAULT_MAX_PENDING = 4096
DEFAULT_STALL_TIMEOUT_S = 120.0  # a loop round (one step) longer than this: /health is 503

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 503)}


def create_app(engine: Any, *, served_model_name: str, api_key: str | None = None,
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
    if not served_model_name:
        raise ValueError(f"served_model_name must be a non-empty string, got {served_model_name!r}")
    if not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be a positive integer, got {max_request_bytes!r}")
    if not stall_timeout_s > 0:
        raise ValueError(f"stall_timeout_s must be positive, got {stall_timeout_s!r}")
    tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
    async_engine = AsyncEngine(engine, max_pending=max_pending, on_fatal=on_engine_dead)
    metrics = ServerMetrics(served_model_name, max_model_len=engine.max_model_len,
                            block_size=engine.args.block_size,
                            cache_info=cache_config_info(engine))
    serving = OpenAIServing(async_engine, model_name=served_model_name, metrics=metrics,
                            tool_parser=tool_parser, strict_request_fields=strict_request_fields,
                            system_fingerprint=system_fingerprint(engine))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            if on_ready is not None:
                on_ready()
            yield
        finally:
            async_engine.shutdown()
            serving.close()

    app = FastAPI(title="pagedkv", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API of a paged-KV-cache LLM engine")
    app.state.async_engine = async_engine
    app.state.serving = serving
    app.state.metrics = metrics
    install_error_handlers(app)
    access = DashboardAccess(api_key)
    if api_key:
        _install_api_key(app, access)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_bytes)

    # vLLM's liveness answers: 200 with an empty body, or 503 with an error (JSON here).
    liveness = {"response_class": Response, "responses": {
        200: {"description": "the engine is serving (empty body, as vLLM's)"},
        503: {"model": ErrorResponse, "description": "shutting down, dead or wedged"}}}

    @app.get("/health", **liveness)
    async def health() -> Response:
        if not async_engine.is_running or async_engine.draining:
            reason = "the server is shutting down" if async_engine.draining else None
            return error_response(APIError(reason or async_engine.error or "engine loop not running",
                                           status_code=503, type="server_unavailable"))
        busy_s = async_engine.busy_for()
        if busy_s > stall_timeout_s:
            return error_response(APIError(
                f"the engine has not finished a step or taken its work for {busy_s:.0f} s "
                f"(stall timeout "
                f"{stall_timeout_s:g} s): it looks wedged", status_code=503,
                type="server_unavailable"))
        return Response(status_code=200)

    @app.get("/ping", **liveness)
    async def ping() -> Response:
        """vLLM's (SageMaker's) liveness route: the same answer as /health."""
        return await health()

    @app.post("/ping", **liveness)
    async def ping_post() -> Response:
        return await health()

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize_route(body: TokenizeCompletionRequest | TokenizeChatRequest
                             ) -> TokenizeResponse:
        return await serving.run_tokenizer(tokenize, serving, body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        return await serving.run_tokenizer(detokenize, serving, body)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/kv_cache_info")
    async def kv_cache_info() -> dict[str, Any]:
        """How this engine hashes prefix blocks, for a KV-aware router, and what a block is:
        the KV cache's format ("auto" resolved) and one block's bytes (read-only)."""
        args = engine.args
        return {"model": served_model_name, "block_size": args.block_size,
                "prefix_caching_hash_algo": args.prefix_caching_hash_algo,
                "enable_prefix_caching": args.enable_prefix_caching,
                "num_gpu_blocks": getattr(engine, "num_gpu_blocks", None),
                "kv_cache_dtype": getattr(engine, "kv_cache_dtype", args.kv_cache_dtype),
                "block_bytes": getattr(engine, "block_bytes", None)}

    @app.get("/metrics")
    async def prometheus_metrics(raw: Request) -> Response:
        """Every family, or with `?name[]=...` only those samples (prometheus_client's filter,
        as on vLLM's /metrics: a router's load scrape renders three gauges)."""
        try:
            metrics.update(await async_engine.get_stats())
        except (EngineDeadError, TimeoutError) as exc:
            raise APIError(str(exc), status_code=503, type="server_unavailable") from exc
        names = raw.query_params.getlist("name[]")
        return Response(metrics.render(names or None), media_type=metrics.content_type)

    def model_card() -> ModelCard:
        vocab = getattr(engine, "vocab_size", None) or getattr(serving.tokenizer, "vocab_size", None)
        return ModelCard(id=served_model_name, root=getattr(engine.args, "model", None),
                         max_model_len=serving.max_model_len,
                         vocab_size=vocab if isinstance(vocab, int) else None)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def model(model_id: str) -> ModelCard:
        serving.check_model(model_id)
        return model_card()

    @app.post("/v1/completions", responses=_ERRORS)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await create_completion(serving, body, raw)

    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(serving, body, raw)

    @app.post("/v1/responses", responses=_ERRORS)
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        """OpenAI's Responses API, text in and out (serving_responses.py)."""
        return await create_response(serving, body, raw)

    @app.post("/v1/pin", response_model=PinResponse, responses=_ERRORS)
    async def pin_route(body: PinRequest) -> PinResponse:
        """Keep a prompt's prefix blocks cached (never evicted) until /v1/unpin."""
        return await pin(serving, body)

    @app.post("/v1/unpin", response_model=PinResponse, responses=_ERRORS)
    async def unpin_route(body: PinRequest) -> PinResponse:
        return await pin(serving, body, unpin=True)

    app.include_router(make_dashboard_router(async_engine, serving, metrics, served_model_name,
                                             access))
    return app


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
