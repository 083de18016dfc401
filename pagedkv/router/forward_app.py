"""`ForwardRoutes`: the router's forwarded /v1 routes as a plain ASGI middleware, ahead of
FastAPI's routing, dependency and validation machinery (the router never validates a body: the
backend does).

A POST to a forwarded path: the API key checked (the server's own check), the body read (the
body-size limit is the `BodySizeLimitMiddleware` outside this one), the answer from the
`Forwarder` sent. One task watches for the client's disconnect over the whole request and
cancels it, so the attempt in progress (or the stream being relayed) closes its upstream
connection and the backend aborts the request. Any other method on those paths is a 405;
every other path goes on to the app.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedkv.http.auth import bearer_key_matches, invalid_api_key
from pagedkv.http.errors import APIError, error_response
from pagedkv.router.proxy import REQUEST_ID_HEADER, SESSION_HEADER, Forwarder

_HEADERS = {b"authorization": "authorization", SESSION_HEADER.encode(): "session",
            REQUEST_ID_HEADER.encode(): "request_id"}


def _headers(scope: Scope) -> dict[str, str]:
    """The request headers the router reads, by their role in `_HEADERS`."""
    found: dict[str, str] = {}
    for name, value in scope["headers"]:
        role = _HEADERS.get(name.lower())
        if role is not None:
            found[role] = value.decode("latin-1")
    return found


async def _body(receive: Receive) -> bytes | None:
    """The whole request body; None when the client disconnects first."""
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


class ForwardRoutes:
    """Answers POSTs to `paths` with `forwarder()` (read per request: the app's lifespan
    creates it); `api_key`, when set, is required as a bearer token."""

    def __init__(self, app: ASGIApp, *, paths: Collection[str],
                 forwarder: Callable[[], Forwarder], api_key: str | None = None) -> None:
        self.app = app
        self.paths = frozenset(paths)
        self.forwarder = forwarder
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        if scope["method"] != "POST":
            await error_response(APIError("Method Not Allowed", status_code=405,
                                          type="method_not_allowed"))(scope, receive, send)
            return
        headers = _headers(scope)
        if self.api_key and not bearer_key_matches(headers.get("authorization"), self.api_key):
            await error_response(invalid_api_key())(scope, receive, send)
            return
        body = await _body(receive)
        if body is not None:
            await self._until_disconnect(scope, receive, send, body, headers)

    async def _forward(self, scope: Scope, send: Send, body: bytes,
                       headers: dict[str, str]) -> None:
        try:
            answer = await self.forwarder().forward(
                body, scope["path"], session=headers.get("session"),
                request_id=headers.get("request_id"))
        except APIError as exc:
            answer = error_response(exc)
        await answer(scope, _no_receive, send)

    async def _until_disconnect(self, scope: Scope, receive: Receive, send: Send, body: bytes,
                                headers: dict[str, str]) -> None:
        """Forward in this task, cancelling it when the client disconnects before the answer's
        last byte is sent (what is left would go nowhere). Only the watcher reads `receive`
        (the body was read already: what comes now is the disconnect)."""
        task = asyncio.current_task()
        assert task is not None  # an ASGI app always runs in a task
        answered = gone = False

        async def sending(message: Message) -> None:
            nonlocal answered
            if message["type"] == "http.response.body" and not message.get("more_body"):
                answered = True  # uvicorn's receive() says "disconnect" from here on
            await send(message)

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            if not answered:
                gone = True
                task.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await self._forward(scope, sending, body, headers)
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()  # the client left: nothing to answer, nothing to raise
        finally:
            answered = True
            watcher.cancel()


async def _no_receive() -> Message:
    """The `receive` handed to an answer: the watcher alone reads the client's."""
    raise RuntimeError("a forwarded answer must not read the request")
