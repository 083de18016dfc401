"""`RawUpstream`: HTTP/1.1 to the backends on plain asyncio streams, parsed by httptools (the C
llhttp parser uvicorn uses), with a keep-alive pool per backend.

Why not httpx on this path: httpx parses every streamed chunk in Python (h11) and wraps it in
several layers of async iterators; here a stream's bytes are read in large pieces, the parser
undoes the chunked encoding in C and the body goes on as the bytes that arrived (no event
parsing). A keep-alive connection the backend closed while it sat idle (uvicorn closes them
after 5 s) is noticed when the request gets no byte back, and the request is sent once more on
a new connection; idle connections older than `keepalive_s` are not reused at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools

from pagedkv.router.upstream import UpstreamAnswer, UpstreamError

READ_BYTES = 64 * 1024  # one read's most; a stream's chunk is whatever arrived together
DEFAULT_KEEPALIVE_S = 4.0  # under uvicorn's 5 s keep-alive timeout
MAX_IDLE_PER_BACKEND = 64


@functools.lru_cache(maxsize=1024)
def _split(url: str) -> tuple[tuple[str, str, int], str, str]:
    """((scheme, host, port), path with query, Host header) of an http(s) URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"backend URL must be http(s)://host[:port]/..., got {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return (parts.scheme, parts.hostname, port), path, parts.netloc


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def reusable(self, now: float, keepalive_s: float) -> bool:
        return (now - self.idle_since < keepalive_s and not self.writer.is_closing()
                and not self.reader.at_eof())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class _Message:
    """httptools' callbacks for one response: its headers (lower-cased names), body pieces not
    yet handed on, whether it is complete."""

    def __init__(self) -> None:
        self.headers: dict[bytes, bytes] = {}
        self.headers_done = False
        self.complete = False
        self.body: list[bytes] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    def ends_at_close(self) -> bool:
        """True when the body has neither a length nor chunks: it ends when the connection
        closes (so a close is its end, not a cut)."""
        return (b"content-length" not in self.headers
                and b"chunked" not in self.headers.get(b"transfer-encoding", b"").lower())


class _RawAnswer:
    def __init__(self, pool: RawUpstream, key: tuple[str, str, int], conn: _Connection,
                 parser: httptools.HttpResponseParser, message: _Message) -> None:
        self._pool = pool
        self._key = key
        self._conn = conn
        self._parser = parser
        self._message = message
        self._open = True
        # (httptools' should_keep_alive() reads False once the message is complete)
        self._keep_alive = (parser.get_http_version() == "1.1" and not message.ends_at_close()
                            and b"close" not in message.headers.get(b"connection", b"").lower())
        self.status_code = parser.get_status_code()
        self.content_type = message.headers.get(b"content-type", b"").decode("latin-1")

    async def chunks(self) -> AsyncIterator[bytes]:
        message = self._message
        while True:
            if message.body:
                data = b"".join(message.body)
                message.body.clear()
                yield data
            elif message.complete or not self._open:
                self._finish()
                return
            else:
                await self._feed()

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    async def _feed(self) -> None:
        try:
            data = await self._conn.reader.read(READ_BYTES)
            if not data:
                if not self._message.ends_at_close():
                    raise ConnectionResetError("the backend closed the connection before the "
                                               "end of its answer")
                self._message.complete = True
                self._conn.close()
                self._open = False
                return
            self._parser.feed_data(data)
        except (OSError, httptools.HttpParserError) as exc:
            await self.aclose()
            raise UpstreamError(repr(exc), connected=True) from exc

    def _finish(self) -> None:
        """The answer was read to its end: its connection goes back to the pool (or closes)."""
        if not self._open:
            return
        self._open = False
        if self._message.complete and self._keep_alive:
            self._pool._release(self._key, self._conn)
        else:
            self._conn.close()

    async def aclose(self) -> None:
        if self._open and not self._message.complete:
            self._open = False
            self._conn.close()
        self._finish()


class RawUpstream:
    """Keep-alive pools of HTTP/1.1 connections, one per backend (scheme, host, port). A
    connection is opened within `connect_timeout_s` (else UpstreamError, not connected).
    Mutates only its pools; one per event loop."""

    def __init__(self, *, connect_timeout_s: float, keepalive_s: float = DEFAULT_KEEPALIVE_S,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        if not connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be positive, got {connect_timeout_s!r}")
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self._ssl = ssl_context
        self._idle: dict[tuple[str, str, int], deque[_Connection]] = {}

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> UpstreamAnswer:
        return await self._send("POST", url, body, headers)

    async def get(self, url: str, headers: dict[str, str] | None = None) -> UpstreamAnswer:
        return await self._send("GET", url, None, headers or {})

    async def _send(self, method: str, url: str, body: bytes | None,
                    headers: dict[str, str]) -> UpstreamAnswer:
        key, path, host = _split(url)
        head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        if body is not None:
            head += f"content-length: {len(body)}\r\n"
        request = (f"{method} {path} HTTP/1.1\r\nhost: {host}\r\n{head}\r\n"
                   ).encode("latin-1") + (body or b"")
        while True:
            conn, reused = await self._acquire(key)
            message = _Message()
            parser = httptools.HttpResponseParser(message)
            got = False
            try:
                conn.writer.write(request)
                await conn.writer.drain()
                while not message.headers_done:
                    data = await conn.reader.read(READ_BYTES)
                    if not data:
                        raise ConnectionResetError("the backend closed the connection without "
                                                   "answering")
                    got = True
                    parser.feed_data(data)
            except (OSError, httptools.HttpParserError) as exc:
                conn.close()
                if reused and not got:  # a keep-alive connection it had closed: a new one
                    continue
                raise UpstreamError(repr(exc), connected=True) from exc
            except BaseException:  # cancelled (a timeout): the connection is in an unknown state
                conn.close()
                raise
            return _RawAnswer(self, key, conn, parser, message)

    async def _acquire(self, key: tuple[str, str, int]) -> tuple[_Connection, bool]:
        """An idle connection to `key` (True) or a new one (False)."""
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.reusable(now, self.keepalive_s):
                return conn, True
            conn.close()
        scheme, host, port = key
        if scheme == "https" and self._ssl is None:
            self._ssl = ssl.create_default_context()  # once: it reads the CA store (~25 ms)
        tls = self._ssl if scheme == "https" else None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(host, port, ssl=tls,
                                                               limit=READ_BYTES)
        except TimeoutError as exc:
            raise UpstreamError(f"no connection to {host}:{port} within "
                                f"{self.connect_timeout_s:g} s", connected=False) from exc
        except OSError as exc:
            raise UpstreamError(repr(exc), connected=False) from exc
        return _Connection(reader, writer), False

    def _release(self, key: tuple[str, str, int], conn: _Connection) -> None:
        idle = self._idle.setdefault(key, deque())
        if len(idle) >= MAX_IDLE_PER_BACKEND:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def aclose(self) -> None:
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
        self._idle.clear()
