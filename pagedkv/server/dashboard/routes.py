"""The dashboard's routes, one APIRouter: `GET /dashboard` (the page), `/dashboard/static/*`
(its assets, shipped in the package: no CDN), `GET /dashboard/events` (SSE: a snapshot, then at
most `MAX_UPDATES_PER_S` coalesced updates a second), `GET /dashboard/api/request/{id}` (a live
request's block table), `GET /dashboard/api/explain/{id}` (a recent finished request's miss
explanation), `GET|POST|DELETE /dashboard/session` (with an API key: the page's session cookie,
access.py) and `POST /v1/cache/explain` (a completion or chat body: where its KV is, block by
block; nothing is generated; behind the API key like every /v1 route).

Everything that reads engine state is a utility call of the engine core ("dashboard.*":
pagedkv/engine/dashboard_calls.py), awaited without blocking the event loop or the engine loop
thread (`AsyncEngine.call_utility`): the same in-process and with the core in its own process. The core's feed records nothing while no
/dashboard/events stream is open. With data parallelism the block feed is core 0's and each
update also carries every core's load (`cores`: KV usage, running, waiting, prefix hits).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response

from pagedkv.engine.async_engine import EngineDeadError
from pagedkv.http.dashboard_access import DashboardAccess, make_session_router
from pagedkv.http.errors import APIError
from pagedkv.http.protocol import ChatCompletionRequest, CompletionRequest
from pagedkv.http.sse import SSEResponse

STATIC_DIR = Path(__file__).parent / "static"
STATIC_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html",
                ".png": "image/png"}
MAX_UPDATES_PER_S = 10


async def _call(async_engine: Any, method: str, *args: Any) -> Any:
    """`method` ("dashboard.drain", ...) run by the engine core; ValueError -> 400, a dead
    engine or no answer in time -> 503, others -> 500."""
    try:
        return await async_engine.call_utility(method, *args)
    except ValueError as exc:
        raise APIError(str(exc)) from exc
    except (EngineDeadError, TimeoutError) as exc:
        raise APIError(str(exc), status_code=503, type="server_unavailable") from exc
    except Exception as exc:  # reported to the caller; the engine loop goes on
        raise APIError(f"{type(exc).__name__}: {exc}", status_code=500,
                       type="internal_error") from exc


def _ttft(metrics: Any) -> dict[str, float]:
    """The TTFT histogram's cumulative sum and count (for a rate chart)."""
    try:
        child = metrics.ttft.children[0]
        return {"ttft_sum": child._sum.get(), "ttft_count": sum(b.get() for b in child._buckets)}
    except (AttributeError, IndexError):  # prometheus_client internals moved: no TTFT chart
        return {}


def _num_cores(engine: Any) -> int:
    """The engine's data-parallel cores (1 without data parallelism)."""
    args = getattr(engine, "args", None)
    return getattr(args, "data_parallel_size", 1) or 1


def core_rows(stats: list[Any]) -> list[dict[str, Any]]:
    """Each engine core's load for the page (its `EngineStats`, core 0 first)."""
    return [{"core": i, "kv_cache_usage": s.kv_cache_usage, "num_running": s.num_running,
             "num_waiting": s.num_waiting, "num_blocks": s.num_blocks,
             "num_free_blocks": s.num_free_blocks, "prefix_cache_hits": s.prefix_cache_hits,
             "prefix_cache_queries": s.prefix_cache_queries}
            for i, s in enumerate(stats)]


def make_dashboard_router(async_engine: Any, serving: Any, metrics: Any,
                          served_model_name: str, access: DashboardAccess | None = None
                          ) -> APIRouter:
    """The routes above, over one engine (its block feed lives in its core). `access`: who may
    read the data routes (the app's middleware enforces it; None: open)."""
    router = APIRouter()
    access = access or DashboardAccess(None)
    router.include_router(make_session_router(access))

    @router.get("/dashboard", include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse((STATIC_DIR / "index.html").read_text(encoding="utf-8"))

    @router.get("/dashboard/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        path = STATIC_DIR / name
        if "/" in name or name.startswith(".") or not path.is_file() \
                or path.suffix not in STATIC_TYPES:
            raise APIError(f"no dashboard asset {name!r}", status_code=404, type="not_found")
        return FileResponse(path, media_type=STATIC_TYPES[path.suffix])

    @router.get("/dashboard/events", include_in_schema=False)
    async def events() -> SSEResponse:
        sub, snap = await _call(async_engine, "dashboard.subscribe")
        snap["model"] = served_model_name
        engine = async_engine.engine  # the KV cache's format ("auto" resolved) and block bytes
        snap["kv_cache_dtype"] = getattr(engine, "kv_cache_dtype", None)
        snap["block_bytes"] = getattr(engine, "block_bytes", None)
        num_cores = _num_cores(engine)
        snap["data_parallel_size"] = num_cores
        loop = asyncio.get_running_loop()
        closed = False

        def close() -> None:
            nonlocal closed
            if not closed:
                closed = True
                if async_engine.is_running:
                    loop.create_task(_call(async_engine, "dashboard.unsubscribe", sub))

        async def stream() -> AsyncIterator[str]:
            yield f"event: snapshot\ndata: {json.dumps(snap, separators=(',', ':'))}\n\n"
            period = 1.0 / MAX_UPDATES_PER_S
            while async_engine.is_running and not async_engine.draining:
                started = loop.time()
                update = await _call(async_engine, "dashboard.drain", sub)
                update["stats"].update(_ttft(metrics))
                if num_cores > 1:  # the block grid is core 0's; every core's load beside it
                    update["cores"] = core_rows(await _call(async_engine, "get_core_stats"))
                yield f"event: update\ndata: {json.dumps(update, separators=(',', ':'))}\n\n"
                await asyncio.sleep(max(period - (loop.time() - started), 0.0) or 0.001)

        return SSEResponse(stream(), on_close=close)

    @router.get("/dashboard/api/request/{request_id:path}", include_in_schema=False)
    async def request_table(request_id: str) -> JSONResponse:
        table = await _call(async_engine, "dashboard.block_table", request_id)
        if table is None:
            raise APIError(f"no live request {request_id!r}", status_code=404, type="not_found")
        return JSONResponse(table)

    @router.get("/dashboard/api/explain/{request_id:path}", include_in_schema=False)
    async def explain_finished(request_id: str) -> JSONResponse:
        answer = await _call(async_engine, "dashboard.explain_recent", request_id)
        if answer is None:
            raise APIError(f"request {request_id!r} is not among the recent finished requests",
                           status_code=404, type="not_found")
        return JSONResponse(answer)

    @router.post("/v1/cache/explain")
    async def explain(body: CompletionRequest | ChatCompletionRequest) -> JSONResponse:
        """Where the KV of this completion or chat prompt is, block by block, and why a block
        is not on the device. Nothing is generated."""
        serving.check_model(body.model)
        token_ids = await _prompt_ids(serving, body)
        answer = await _call(async_engine, "dashboard.explain", token_ids, body.cache_salt)
        answer["model"] = served_model_name
        return JSONResponse(answer)

    return router


async def _prompt_ids(serving: Any, body: CompletionRequest | ChatCompletionRequest
                      ) -> list[int]:
    """The token ids the completions or chat route would run for `body` (its first prompt),
    refused (400) here, before the engine core, whenever a completion would refuse them."""
    from pagedkv.http.prompt_render import tokenize_chat, tokenize_prompts

    param = "prompt"
    if isinstance(body, ChatCompletionRequest):
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        ids = await serving.run_tokenizer(tokenize_chat, serving, body, tools)
        param = "messages"
    else:
        several = isinstance(body.prompt, list) and not isinstance(body.prompt[0], int)
        if several and len(body.prompt) != 1:  # refused before any of them is tokenized
            raise APIError(f"explain takes one prompt, got {len(body.prompt)}", param="prompt")
        prompts = await serving.run_tokenizer(tokenize_prompts, serving, body.prompt,
                                              body.truncate_prompt_tokens is None)
        ids = prompts[0]
    ids = serving.truncate(body, [ids])[0]
    serving.check_prompt_ids(ids, param)
    return ids

