"""vLLM's liveness routes: GET /health, GET|POST /ping. 200 with an empty body while the engine
serves; 503 with an error (JSON here) while it shuts down, is dead, or looks wedged (one loop
round longer than the app's `stall_timeout_s`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagedkv.http.errors import APIError, error_response
from pagedkv.http.protocol import ErrorResponse

router = APIRouter()

# vLLM's liveness answers: 200 with an empty body, or 503 with an error (JSON here).
LIVENESS = {"response_class": Response, "responses": {
    200: {"description": "the engine is serving (empty body, as vLLM's)"},
    503: {"model": ErrorResponse, "description": "shutting down, dead or wedged"}}}


@router.get("/health", **LIVENESS)
async def health(raw: Request) -> Response:
    async_engine = raw.app.state.async_engine
    stall_timeout_s = raw.app.state.stall_timeout_s
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


@router.get("/ping", **LIVENESS)
async def ping(raw: Request) -> Response:
    """vLLM's (SageMaker's) liveness route: the same answer as /health."""
    return await health(raw)


@router.post("/ping", **LIVENESS)
async def ping_post(raw: Request) -> Response:
    return await health(raw)
