"""Forwarding one /v1 request: pick a backend, send, retry elsewhere while nothing has reached
the client, relay the answer.

A request naming a model goes only to backends serving it (a model no backend serves is a 404,
as on the server). Nothing is sent to the client before the backend's first body bytes arrive,
so every failure up to then is retried on another backend (each backend at most once per
request): a refused or dropped connection (the backend is also marked down), a 5xx answer, a
connection cut before the first byte, no first byte within `first_byte_timeout_s` (a wedged
backend: it is ejected for a while, and the request gets a 504 when no backend answers in
time), or a 200 whose body is not JSON (ejected too; a 502 when nothing better comes). A
non-streaming answer is read whole before it is relayed (its first byte is the whole answer:
the timeout bounds its generation). A stream (an SSE answer; a stream request answered with
plain JSON is relayed whole) is relayed chunk by chunk as the bytes arrive, a backend silent for
`first_byte_timeout_s` mid-stream is ejected, and it always ends with `data: [DONE]`
(relay.py). The bytes travel through an `Upstream` (upstream.py); the ASGI side
(forward_app.py) cancels a request whose client disconnects, which closes the upstream
connection, so the backend aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
from starlette.responses import Response

from pagedkv.http.errors import APIError, error_response, model_not_found
from pagedkv.router.backend import Backend
from pagedkv.router.policies import Candidate, RouteRequest
from pagedkv.router.relay import Cut, RelayResponse, relay
from pagedkv.router.remote_tokens import BackendTokenizer, tokenize_call
from pagedkv.router.router import Router, Ticket
from pagedkv.router.upstream import HttpxUpstream, Upstream, UpstreamAnswer, UpstreamError

logger = logging.getLogger("pagedkv.router")

SESSION_HEADER = "x-session-id"
REQUEST_ID_HEADER = "x-request-id"  # passed on to the backend (it names the response's id)
BACKEND_HEADER = "x-pagedkv-backend"  # on every forwarded answer: the backend that gave it
DEFAULT_FIRST_BYTE_TIMEOUT_S = 60.0
# A body up to this size is tokenized and hashed on the event loop: that takes less than the
# hop to a worker thread and back (which waits for the GIL on a busy box); a larger one (a
# long text prompt: milliseconds of tokenizing) goes to a thread, not to stall other requests.
INLINE_HASH_BYTES = 16 * 1024


# Picks a backend for a request among those not yet tried (names); None when none is left.
Pick = Callable[[RouteRequest, list[str]], "tuple[Backend, Candidate] | None"]


@dataclass
class _Failure:
    """An attempt that failed before the client saw a byte; `response` is what to answer
    (the backend's own 5xx, a 504 or a 502) if no other backend does better."""

    reason: str
    response: Response | None = None


@dataclass(frozen=True)
class _BodyFields:
    stream: bool = False
    user: str | None = None
    model: str | None = None


class _TopLevel(msgspec.Struct):
    """The three top-level fields the router reads, whatever their type; msgspec skips every
    other field without building it (a prompt of thousands of token ids is never a list)."""

    stream: Any = None
    user: Any = None
    model: Any = None


_TOP_LEVEL = msgspec.json.Decoder(_TopLevel)


def _body_fields(body: bytes) -> _BodyFields:
    """The fields of a JSON body the router reads; the defaults when it is not a JSON object
    (the backend answers the 400)."""
    try:
        top = _TOP_LEVEL.decode(body)
    except (msgspec.DecodeError, ValueError):
        return _BodyFields()
    return _BodyFields(stream=top.stream is True,
                       user=top.user if isinstance(top.user, str) else None,
                       model=top.model if isinstance(top.model, str) else None)


def _is_json(content: bytes) -> bool:
    try:
        json.loads(content)
    except ValueError:
        return False
    return True


class Forwarder:
    """Sends requests to the router's backends through `upstream` (default: `client`'s, whose
    read timeout stays off: a long stream is not a failure; `first_byte_timeout_s` bounds the
    wait for its start). `client` also asks backends to tokenize (a router without a
    tokenizer)."""

    def __init__(self, router: Router, client: httpx.AsyncClient, *,
                 upstream: Upstream | None = None, backend_api_key: str | None = None,
                 first_byte_timeout_s: float = DEFAULT_FIRST_BYTE_TIMEOUT_S) -> None:
        if not first_byte_timeout_s > 0:
            raise ValueError(f"first_byte_timeout_s must be positive, got "
                             f"{first_byte_timeout_s!r}")
        self.router = router
        self.client = client
        self.upstream = upstream if upstream is not None else HttpxUpstream(client)
        self.first_byte_timeout_s = first_byte_timeout_s
        self.headers = {"content-type": "application/json", **self.auth_headers(backend_api_key)}
        self.remote_tokenizer = BackendTokenizer(client, self.auth_headers(backend_api_key))

    @staticmethod
    def auth_headers(backend_api_key: str | None) -> dict[str, str]:
        """The headers that carry the backends' key (none without one)."""
        return {"authorization": f"Bearer {backend_api_key}"} if backend_api_key else {}

    async def forward(self, body: bytes, path: str, *, session: str | None = None,
                      request_id: str | None = None) -> Response | RelayResponse:
        """The answer to a POST of `body` to `path` from a backend (an ASGI app to send).
        `session` is the client's session header, `request_id` its x-request-id (both may be
        None). APIError when no backend can take it."""
        fields = _body_fields(body)
        if self.router.knows_model(fields.model) is False:
            self.router.metrics.requests.labels("none", "404").inc()
            raise model_not_found(fields.model or "")
        session = session or fields.user
        request = RouteRequest(session=session, model=fields.model)
        if self.router.needs_prompt_hashes:
            request = await self.hashed_request(path, body, session, fields.model)
        headers = self.headers if request_id is None else {
            **self.headers, REQUEST_ID_HEADER: request_id}
        return await self._place(request, path, body, fields.stream, headers)

    async def hashed_request(self, path: str, body: bytes, session: str | None,
                             model: str | None) -> RouteRequest:
        """The request with its prompt's block hashes: tokenized here with the router's own
        tokenizer (a large body off the event loop), else on a backend serving `model` (its
        /tokenize)."""
        hasher = self.router.hasher
        plain = RouteRequest(session=session, model=model)
        if hasher is None:
            return plain
        if hasher.tokenizer is not None:
            if len(body) <= INLINE_HASH_BYTES:
                hashed = hasher.route_request(path, body, session)
            else:
                hashed = await asyncio.to_thread(hasher.route_request, path, body, session)
            return dataclasses.replace(hashed, model=model)
        call = tokenize_call(path, body)
        backend = self.router.tokenizer_backend(model)
        if call is None or backend is None:
            return plain
        ids = await self.remote_tokenizer.token_ids(backend.url, call)
        if ids is None:
            return plain
        return dataclasses.replace(
            hasher.route_request_from_ids(ids, call.cache_salt, session), model=model)

    async def _place(self, request: RouteRequest, path: str, body: bytes, stream: bool,
                     headers: dict[str, str] | None = None,
                     pick: Pick | None = None) -> Response | RelayResponse:
        """Send `body` to the backend `pick` gives (default: the router's policy), retrying
        on the next one it gives while nothing reached the client."""
        pick = pick or (lambda r, tried: self.router.route(r, exclude=tried))
        tried: list[str] = []
        failure: _Failure | None = None
        while (picked := pick(request, tried)) is not None:
            backend, candidate = picked
            tried.append(backend.name)
            ticket = self.router.begin(backend, request, candidate)
            outcome = await self._attempt(backend, ticket, path, body, stream,
                                          self.headers if headers is None else headers)
            if not isinstance(outcome, _Failure):
                return outcome
            failure = outcome
            self.router.metrics.retries.labels(backend.name, outcome.reason).inc()
            logger.info("request failed on %s (%s); trying another backend if one is left",
                        backend.name, outcome.reason)
        if failure is not None and failure.response is not None:
            self.router.metrics.requests.labels("none", str(failure.response.status_code)).inc()
            return failure.response
        self.router.metrics.requests.labels("none", "503").inc()
        raise APIError("no backend is available to serve this request" + (
            f" (last failure: {failure.reason})" if failure else ""), status_code=503,
            type="server_unavailable")

    async def _attempt(self, backend: Backend, ticket: Ticket, path: str, body: bytes,
                       stream: bool, headers: dict[str, str]
                       ) -> Response | RelayResponse | _Failure:
        """One try on `backend`. Owns `ticket` (and the upstream answer): ends it, or hands
        both to the relayed stream."""
        handed_over = False
        answer: UpstreamAnswer | None = None
        first: bytes | None = None
        content = b""
        try:
            try:
                async with asyncio.timeout(self.first_byte_timeout_s):
                    answer = await self.upstream.post(backend.url + path, body, headers)
                    if (stream and answer.status_code == 200
                            and answer.content_type.startswith("text/event-stream")):
                        chunks = answer.chunks()
                        first = await anext(chunks)
                    else:
                        content = await answer.read()
            except TimeoutError:
                return self._timed_out(backend)
            except UpstreamError as exc:
                self.router.mark_down(backend, f"request failed: {exc}")
                return _Failure("connect" if answer is None else "read")
            except StopAsyncIteration:
                self.router.mark_down(backend, "stream ended before its first byte")
                return _Failure("read")
            if first is None:
                return self._whole_answer(backend, answer.status_code, answer.content_type,
                                          content, stream)
            self.router.record_success(backend)
            handed_over = True
            return RelayResponse(
                relay(first, chunks, idle_timeout_s=self.first_byte_timeout_s,
                      on_cut=lambda why, cut: self._stream_cut(backend, why, cut),
                      on_done=lambda: self.router.metrics.requests.labels(
                          backend.name, "200").inc()),
                status_code=answer.status_code, media_type=answer.content_type,
                headers={BACKEND_HEADER: backend.name},
                on_close=lambda: self._close(answer, ticket))
        finally:
            if not handed_over:
                ticket.end()
                if answer is not None:
                    with contextlib.suppress(Exception):
                        await answer.aclose()

    def _whole_answer(self, backend: Backend, status: int, media_type: str,
                      content: bytes, stream: bool) -> Response | _Failure:
        """A backend's answer read whole: relayed, or a failure to retry elsewhere."""
        answer = Response(content, status_code=status, media_type=media_type or None,
                          headers={BACKEND_HEADER: backend.name})
        if status >= 500:
            return _Failure(f"status_{status}", answer)
        if status == 200 and not _is_json(content):  # (a stream's SSE never comes here)
            reason = "answered 200 with a body that is not JSON"
            self.router.eject(backend, reason)
            return _Failure("bad_answer", error_response(APIError(
                f"the backend {backend.name} {reason}", status_code=502, type="bad_gateway",
                code="invalid_upstream_response")))
        self.router.record_success(backend)
        self.router.metrics.requests.labels(backend.name, str(status)).inc()
        return answer

    def _timed_out(self, backend: Backend) -> _Failure:
        reason = f"no first byte within {self.first_byte_timeout_s:g} s"
        self.router.eject(backend, reason)
        return _Failure("timeout", error_response(APIError(
            f"no backend answered within the first-byte timeout "
            f"({self.first_byte_timeout_s:g} s)", status_code=504, type="timeout",
            code="upstream_timeout")))

    def _stream_cut(self, backend: Backend, message: str, cut: Cut) -> None:
        logger.warning("stream from %s ended early: %s", backend.name, message)
        self.router.metrics.stream_errors.labels(backend.name).inc()
        self.router.metrics.requests.labels(backend.name, "stream_error").inc()
        if cut is Cut.BROKEN:  # the connection broke: the backend may be gone
            self.router.mark_down(backend, message)
        elif cut is Cut.IDLE:  # it went silent mid-stream: wedged
            self.router.eject(backend, message)

    @staticmethod
    async def _close(answer: UpstreamAnswer, ticket: Ticket) -> None:
        ticket.end()
        with contextlib.suppress(Exception):
            await answer.aclose()
