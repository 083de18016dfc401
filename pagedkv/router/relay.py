"""Relaying one backend stream to the client: the bytes as they arrive, and a proper end.

Every relayed stream ends with `data: [DONE]`. A backend stream that ends without one (its
connection cut mid-event, closed early, or silent for longer than the idle timeout) gets an
SSE error event first, after a blank line that closes whatever event was cut, so the client can
tell a truncated answer from a whole one.
`RelayResponse` sends it as a plain ASGI answer (no task per stream: the caller watches for
the client's disconnect, forward_app.py) and runs its `on_close` however the stream ends
(finished, client gone, cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

from starlette.types import Receive, Scope, Send

from pagedkv.http.errors import error_body
from pagedkv.http.sse import SSE_HEADERS, sse_done, sse_event
from pagedkv.router.upstream import UpstreamError

DONE = b"data: [DONE]"
_TAIL = 64  # bytes of the stream kept to see how it ended


class Cut(enum.Enum):
    """How a relayed stream ended without `data: [DONE]`."""

    BROKEN = "broken"  # the connection failed
    INCOMPLETE = "incomplete"  # it closed cleanly, early
    IDLE = "idle"  # no byte within the idle timeout


class RelayResponse:
    """A streamed answer as an ASGI app: the status and headers, `body`'s chunks as they come,
    the end; it awaits `on_close` however it ends (finished, failed, or cancelled)."""

    def __init__(self, body: AsyncGenerator[tuple[bytes, bool], None], *, status_code: int,
                 media_type: str | None, headers: dict[str, str],
                 on_close: Callable[[], Awaitable[None]]) -> None:
        self.body = body
        self.status_code = status_code
        self.on_close = on_close
        fields = {**SSE_HEADERS, **headers}
        if media_type:
            fields["content-type"] = media_type
        self.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1"))
                            for k, v in fields.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            ended = False
            async for chunk, last in self.body:  # nothing comes after a last chunk
                ended = last
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
            if not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            with contextlib.suppress(Exception):
                await self.body.aclose()
            await self.on_close()


def ends_with_done(tail: bytes) -> bool:
    """True when the stream's last event is `data: [DONE]` (trailing blank lines aside)."""
    return tail.rstrip(b"\r\n").replace(b"data:[DONE]", DONE).endswith(DONE)


def error_ending(tail: bytes, message: str) -> bytes:
    """What to send after a stream whose last bytes are `tail` and that did not finish: the
    blank line that closes a cut event, an error event naming `message`, `data: [DONE]`."""
    separator = b"" if tail.endswith(b"\n\n") or not tail else (
        b"\n" if tail.endswith(b"\n") else b"\n\n")
    return (separator + sse_event(error_body(message, "server_unavailable")).encode()
            + sse_done().encode())


class _IdleTimer:
    """Cancels the current task when one wait on the backend (from `since` being set until it
    is None again) lasts `timeout_s`. One timer per stream, re-armed only when it comes due
    (not a timer per chunk); the time spent sending to the client is not counted."""

    def __init__(self, timeout_s: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.timeout_s = timeout_s
        self.since: float | None = None
        self.fired = False
        self.handle = self.loop.call_later(timeout_s, self._due)

    def _due(self) -> None:
        now = self.loop.time()
        if self.since is not None and now - self.since >= self.timeout_s:
            self.fired = True
            if self.task is not None:
                self.task.cancel()
            return
        start = now if self.since is None else self.since
        self.handle = self.loop.call_at(start + self.timeout_s, self._due)

    def close(self) -> None:
        self.handle.cancel()


async def relay(first: bytes, chunks: AsyncIterator[bytes], *, idle_timeout_s: float,
                on_cut: Callable[[str, Cut], None], on_done: Callable[[], None]
                ) -> AsyncGenerator[tuple[bytes, bool], None]:
    """`first`, then `chunks` as they arrive, then an end, as (bytes, last) pairs: `on_done()`
    when the backend sent `data: [DONE]` (its final blank line added when missing); else
    `on_cut(message, cut)` and an error event and `data: [DONE]` (`error_ending`). Waits at
    most `idle_timeout_s` for each next chunk. The chunk that ends with `data: [DONE]` and its
    blank line is marked last (the client's answer ends with it, in one write); the backend's
    stream is then read to its end (the connection goes back to its pool), nothing more
    yielded."""
    tail = first[-_TAIL:]
    if _complete(tail):
        yield first, True
        await _drain(chunks, idle_timeout_s)
        on_done()
        return
    yield first, False
    cut: Cut | None = None
    idle = _IdleTimer(idle_timeout_s)
    try:
        while True:
            idle.since = idle.loop.time()
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            except asyncio.CancelledError:
                if not idle.fired or idle.task is None:
                    raise
                idle.task.uncancel()
                cut, message = Cut.IDLE, f"the backend sent nothing for {idle_timeout_s:g} s"
                break
            except UpstreamError as exc:
                cut, message = Cut.BROKEN, f"the backend serving this stream failed: {exc}"
                break
            idle.since = None
            tail = (tail + chunk)[-_TAIL:]
            if _complete(tail):
                yield chunk, True
                break
            yield chunk, False
    finally:
        idle.close()
    if _complete(tail):
        await _drain(chunks, idle_timeout_s)
        on_done()
        return
    if cut is None and not ends_with_done(tail):
        cut = Cut.INCOMPLETE
        message = "the backend's stream ended without data: [DONE] (the answer is incomplete)"
    if cut is not None:
        on_cut(message, cut)
        yield error_ending(tail, message), True
        return
    yield (b"\n" if tail.endswith(b"\n") else b"\n\n"), True  # (ended with data: [DONE])
    on_done()


def _complete(tail: bytes) -> bool:
    """True when the stream so far ends with `data: [DONE]` and its blank line."""
    return tail.endswith(b"\n\n") and ends_with_done(tail)


async def _drain(chunks: AsyncIterator[bytes], timeout_s: float) -> None:
    """Read what the backend sends after `data: [DONE]` (its stream's end), dropped; a
    failure there is no failure of the answer, which the client has whole."""
    with contextlib.suppress(UpstreamError, TimeoutError):
        async with asyncio.timeout(timeout_s):
            async for _ in chunks:
                pass
