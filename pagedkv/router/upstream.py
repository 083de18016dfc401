"""The router's seam to its backends' HTTP: `Upstream.post` sends one request and hands back an
`UpstreamAnswer` (status and content type as soon as the headers are in; the body as it
arrives). Two kinds: `RawUpstream` (raw_upstream.py, what `pagedkv router` runs: asyncio
streams, httptools' C parser, keep-alive pools, the body relayed in large reads) and
`HttpxUpstream` here (an `httpx.AsyncClient`: the tests' `httpx.MockTransport`).

Every transport failure is an `UpstreamError`; `connected` tells a connection that was never
made (refused, unreachable, connect timeout) from one that broke after the request went out.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import httpx


class UpstreamError(Exception):
    """A backend's connection failed (`connected` False: no connection was ever made)."""

    def __init__(self, message: str, *, connected: bool) -> None:
        super().__init__(message)
        self.connected = connected


class UpstreamAnswer(Protocol):
    """One backend answer, its headers read. `chunks()` yields the body's bytes as they arrive
    (the transfer encoding undone), `read()` the whole body; both raise UpstreamError when the
    connection breaks. `aclose()` (idempotent) ends it: a connection whose answer was not read
    to its end is closed, so the backend sees the client go and aborts the request."""

    status_code: int
    content_type: str

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def read(self) -> bytes: ...

    async def aclose(self) -> None: ...


class Upstream(Protocol):
    """Sends requests to backends."""

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> UpstreamAnswer:
        """POST `body` to `url` (a backend's base URL and path); the answer once its headers
        are in. UpstreamError when the connection fails before that."""
        ...

    async def get(self, url: str, headers: dict[str, str] | None = None) -> UpstreamAnswer:
        """GET `url` (query included), as `post`."""
        ...

    async def aclose(self) -> None:
        """Close every connection it keeps."""
        ...


class _HttpxAnswer:
    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.status_code = response.status_code
        self.content_type = response.headers.get("content-type", "")

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.response.aiter_raw():
                yield chunk
        except httpx.TransportError as exc:
            raise UpstreamError(repr(exc), connected=True) from exc

    async def read(self) -> bytes:
        try:
            return await self.response.aread()
        except httpx.TransportError as exc:
            raise UpstreamError(repr(exc), connected=True) from exc

    async def aclose(self) -> None:
        await self.response.aclose()


class HttpxUpstream:
    """An `Upstream` over `client` (which the caller owns and closes)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> UpstreamAnswer:
        return await self._send(self.client.build_request("POST", url, content=body,
                                                          headers=headers))

    async def get(self, url: str, headers: dict[str, str] | None = None) -> UpstreamAnswer:
        return await self._send(self.client.build_request("GET", url, headers=headers))

    async def _send(self, request: httpx.Request) -> UpstreamAnswer:
        try:
            response = await self.client.send(request, stream=True)
        except httpx.TransportError as exc:
            connected = not isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
            raise UpstreamError(repr(exc), connected=connected) from exc
        return _HttpxAnswer(response)

    async def aclose(self) -> None:
        """Nothing: the client is its owner's to close."""
