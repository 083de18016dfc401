"""BodySizeLimitMiddleware: a request body over `max_bytes` is a 413 with an OpenAI-style body.

A `Content-Length` over the limit is refused before any byte of the body is read (a request
within it goes on untouched: the server never hands on more body than it declares); a chunked
body (no length) is counted as it arrives and refused as soon as it passes the limit, so a
huge upload never sits in memory whole. A plain ASGI middleware (no buffering): streaming
answers pass through untouched.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedkv.http.errors import APIError, error_response


class _BodyTooLarge(HTTPException):
    """Raised by `receive` past the limit; an HTTPException so that FastAPI's body reader
    passes it on (anything else it turns into a 400) to the app's 413 handler."""


def _too_large(max_bytes: int, received: str) -> APIError:
    return APIError(f"request body too large: {received}, the limit is {max_bytes} bytes "
                    "(--max-request-bytes)", status_code=413)


DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # a 4 MiB body is ~1M tokens of text, past any context


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            shown = f"{int(length)} bytes" if length.isdigit() else f"Content-Length {length!r}"
            await error_response(_too_large(self.max_bytes, shown))(scope, receive, send)
            return
        if length is not None:  # (uvicorn never passes on more body than Content-Length says)
            await self.app(scope, receive, send)
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge(413, _too_large(self.max_bytes, f"over {received} bytes").message)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except _BodyTooLarge:
            if not started:
                response = error_response(_too_large(self.max_bytes, f"over {received} bytes"))
                await response(scope, receive, send)
