"""Forwarding one /v1 request: pick a backend, send, retry elsewhere while nothing has reached
the client, relay the answer.

Nothing is sent to the client before the backend's first body bytes arrive, so every failure up
to then is retried on another backend (each backend at most once per request): a refused or
dropped connection (the backend is also marked down), a 5xx answer, or a connection cut before
the first byte. A non-streaming answer is read whole before it is relayed, so it too is retried
if its backend dies mid-request. A stream is relayed chunk by chunk as the bytes arrive; if its
backend dies after the first byte, the client gets an SSE error event and `data: [DONE]`. A
client that disconnects closes the upstream connection, so the backend aborts the request and
frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedkv.router.backend import Backend
from pagedkv.router.policies import RouteRequest
from pagedkv.router.router import Router, Ticket
from pagedkv.server.errors import APIError, error_body
from pagedkv.server.serving import run_unless_disconnected
from pagedkv.server.sse import SSE_HEADERS, sse_done, sse_event

logger = logging.getLogger("pagedkv.router")

SESSION_HEADER = "x-session-id"
BACKEND_HEADER = "x-pagedkv-backend"  # on every forwarded answer: the backend that gave it


@dataclass
class _Failure:
    """An attempt that failed before the client saw a byte; `response` is the backend's own
    answer (a 5xx) to relay if no other backend does better."""

    reason: str
    response: Response | None = None


class RelayResponse(StreamingResponse):
    """A streaming response that awaits `on_close` however it ends (finished, client gone, or
    cancelled before the body started)."""

    def __init__(self, body: AsyncIterator[bytes], *, status_code: int, media_type: str | None,
                 headers: dict[str, str], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(body, status_code=status_code, media_type=media_type,
                         headers={**SSE_HEADERS, **headers})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


def _body_fields(body: bytes) -> tuple[bool, str | None]:
    """(stream, user) of a JSON body; (False, None) when it is not a JSON object (the backend
    answers the 400)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return False, None
    if not isinstance(parsed, dict):
        return False, None
    user = parsed.get("user")
    return parsed.get("stream") is True, user if isinstance(user, str) else None


class Forwarder:
    """Sends requests to the router's backends with `client` (no read timeout of its own: a
    long generation is not a failure)."""

    def __init__(self, router: Router, client: httpx.AsyncClient, *,
                 backend_api_key: str | None = None) -> None:
        self.router = router
        self.client = client
        self.headers = {"content-type": "application/json"}
        if backend_api_key:
            self.headers["authorization"] = f"Bearer {backend_api_key}"

    async def forward(self, raw: Request, path: str) -> Response:
        """Answer `raw` (a POST to `path`) from a backend."""
        body = await raw.body()
        stream, user = _body_fields(body)
        session = raw.headers.get(SESSION_HEADER) or user
        request = RouteRequest(session=session)
        hasher = self.router.hasher
        if self.router.needs_prompt_hashes and hasher is not None:
            request = await asyncio.to_thread(hasher.route_request, path, body, session)
        return await run_unless_disconnected(raw, self._place(request, path, body, stream))

    async def _place(self, request: RouteRequest, path: str, body: bytes,
                     stream: bool) -> Response:
        tried: list[str] = []
        failure: _Failure | None = None
        while (picked := self.router.route(request, exclude=tried)) is not None:
            backend, candidate = picked
            tried.append(backend.name)
            ticket = self.router.begin(backend, request, candidate)
            outcome = await self._attempt(backend, ticket, path, body, stream)
            if isinstance(outcome, Response):
                return outcome
            failure = outcome
            self.router.metrics.retries.labels(backend.name, outcome.reason).inc()
            logger.info("request failed on %s (%s); %s", backend.name, outcome.reason,
                        "retrying" if len(tried) < len(self.router.backends) else "giving up")
        if failure is not None and failure.response is not None:
            return failure.response
        self.router.metrics.requests.labels("none", "503").inc()
        raise APIError("no backend is available to serve this request" + (
            f" (last failure: {failure.reason})" if failure else ""), status_code=503,
            type="server_unavailable")

    async def _attempt(self, backend: Backend, ticket: Ticket, path: str, body: bytes,
                       stream: bool) -> Response | _Failure:
        """One try on `backend`. Owns `ticket` (and the upstream response): ends it, or hands
        both to the relayed stream."""
        upstream: httpx.Response | None = None
        handed_over = False
        try:
            try:
                upstream = await self.client.send(
                    self.client.build_request("POST", backend.url + path, content=body,
                                              headers=self.headers), stream=True)
            except httpx.TransportError as exc:
                self.router.mark_down(backend, f"request failed: {exc!r}")
                return _Failure("connect")
            status = upstream.status_code
            media_type = upstream.headers.get("content-type")
            if not stream or status != 200:
                try:
                    content = await upstream.aread()
                except httpx.TransportError as exc:
                    self.router.mark_down(backend, f"answer cut: {exc!r}")
                    return _Failure("read")
                answer = Response(content, status_code=status, media_type=media_type,
                                  headers={BACKEND_HEADER: backend.name})
                if status >= 500:
                    return _Failure(f"status_{status}", answer)
                self.router.metrics.requests.labels(backend.name, str(status)).inc()
                return answer
            chunks = upstream.aiter_raw()
            try:
                first = await anext(chunks)
            except (httpx.TransportError, StopAsyncIteration) as exc:
                self.router.mark_down(backend, f"stream cut before its first byte: {exc!r}")
                return _Failure("read")
            handed_over = True
            return RelayResponse(self._relay(backend, first, chunks), status_code=status,
                                 media_type=media_type, headers={BACKEND_HEADER: backend.name},
                                 on_close=lambda: self._close(upstream, ticket))
        finally:
            if not handed_over:
                ticket.end()
                if upstream is not None:
                    with contextlib.suppress(Exception):
                        await upstream.aclose()

    async def _relay(self, backend: Backend, first: bytes,
                     chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The stream's bytes as they arrive; an error event and [DONE] if the backend dies."""
        last = first
        yield first
        try:
            async for chunk in chunks:
                last = chunk
                yield chunk
        except httpx.TransportError as exc:
            self.router.mark_down(backend, f"stream cut: {exc!r}")
            self.router.metrics.stream_errors.labels(backend.name).inc()
            separator = b"" if last.endswith(b"\n\n") else b"\n\n"
            message = f"the backend serving this stream failed: {exc!r}"
            yield separator + sse_event(error_body(message, "server_unavailable")).encode()
            yield sse_done().encode()
            self.router.metrics.requests.labels(backend.name, "stream_error").inc()
            return
        self.router.metrics.requests.labels(backend.name, "200").inc()

    @staticmethod
    async def _close(upstream: httpx.Response, ticket: Ticket) -> None:
        ticket.end()
        with contextlib.suppress(Exception):
            await upstream.aclose()
