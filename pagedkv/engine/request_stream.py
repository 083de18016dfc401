"""What `AsyncEngine` hands its callers: one request's stream of outputs, and the errors that
end a stream or refuse a request (the server answers each with its own status).

A stream's outputs are cumulative, so one that waits unread is replaced by the next: a reader
that falls a step behind gets the latest output (every token in it) once, not each step's in
turn. Nothing is lost, and the reader's work per step stays one output however far behind it
was. An end (an abort, an error) is never merged away: it comes after the outputs before it.
The first output is never merged into: its read is the request's first token (TTFT), and the
tokens after it are timed as they come (the inter-token latency histogram counts each once).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterable

from pagedkv.engine.outputs import RequestOutput

ABORTED = object()  # pushed to a request's stream when it was aborted (no more outputs)


class EngineOverloadedError(RuntimeError):
    """More requests in flight than `max_pending` allows (the server answers 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop failed or was shut down; no request can be served any more."""


class EngineStepError(RuntimeError):
    """An engine step raised; the requests in flight were ended (the server answers 500)."""


class RequestStream:
    """The outputs of one engine request, read on the event loop: `async for out in stream`.

    Yields cumulative `RequestOutput`s (the latest one when several came since the last read)
    and stops after the finished one, or without one when the request was aborted. `close()`
    aborts the request if it has not finished and releases its place among the in-flight
    requests; call it exactly when done (it is idempotent). `on_close(stream)`: the engine's
    part of that (called once, from `close()`).
    """

    def __init__(self, request_id: str, on_close: Callable[[RequestStream], None]) -> None:
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()
        self.arrival = time.monotonic()  # when the request came in (callers may set it earlier)
        self.submitted: float | None = None  # when it was queued for the engine loop
        self.finished = False
        self.aborted = False  # ended by an abort, without a finished output
        self._items: deque = deque()  # RequestOutput, an exception, or ABORTED
        self._first: RequestOutput | None = None  # the first output put (kept apart)
        self._waiter: asyncio.Future | None = None
        self._on_close = on_close
        self._closed = False

    def put(self, item: RequestOutput | BaseException | object) -> None:
        """Hand the reader `item` (event loop thread only): an output replaces an unread one
        before it (outputs are cumulative), except the first; an exception or ABORTED ends the
        stream."""
        items = self._items
        if type(item) is RequestOutput:
            if items and type(items[-1]) is RequestOutput and items[-1] is not self._first:
                items[-1] = item
            else:
                items.append(item)
                if self._first is None:
                    self._first = item
        else:
            items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        items = self._items
        while not items:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = items.popleft()
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


def put_all(deliveries: Iterable[tuple[RequestStream, object]]) -> None:
    """`stream.put(item)` for each pair, in order: one engine step's outputs, handed over in
    one call on the streams' event loop (one wake-up per step, not one per request)."""
    for stream, item in deliveries:
        stream.put(item)
