"""What `AsyncEngine` hands its callers: one request's stream of outputs, and the errors that
end a stream or refuse a request (the server answers each with its own status)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from pagedkv.engine.outputs import RequestOutput

ABORTED = object()  # pushed to a request's queue when it was aborted (no more outputs)


class EngineOverloadedError(RuntimeError):
    """More requests in flight than `max_pending` allows (the server answers 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop failed or was shut down; no request can be served any more."""


class EngineStepError(RuntimeError):
    """An engine step raised; the requests in flight were ended (the server answers 500)."""


class RequestStream:
    """The outputs of one engine request, read on the event loop: `async for out in stream`.

    Yields cumulative `RequestOutput`s and stops after the finished one, or without one when
    the request was aborted. `close()` aborts the request if it has not finished and releases
    its place among the in-flight requests; call it exactly when done (it is idempotent).
    `on_close(stream)`: the engine's part of that (called once, from `close()`).
    """

    def __init__(self, request_id: str, on_close: Callable[[RequestStream], None]) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.arrival = time.monotonic()  # when the request came in (callers may set it earlier)
        self.submitted: float | None = None  # when it was queued for the engine loop
        self.finished = False
        self.aborted = False  # ended by an abort, without a finished output
        self._on_close = on_close
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if item is ABORTED:
            self.finished = self.aborted = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._on_close(self)
