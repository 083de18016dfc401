"""Prefill/decode disaggregation in the router (`pagedkv router --prefill URL... --decode
URL...`): each completion runs its prefill on a prefill instance (a KV producer), then decodes
on a decode instance (a KV consumer) that loads the prompt's KV instead of computing it.

Two hops per request, on vLLM's wire (pd_wire.py, the contract vLLM's own PD proxy uses, so
real vLLM instances in PD mode work too):

1. prefill: the client's request with `max_tokens` 1, no stream and `kv_transfer_params`
   asking for a remote decode, to the prefill instance the router's policy picks among the
   prefill set (kv-aware: prefix hits against load, the prefix index over the prefill set).
   It is bounded by `prefill_timeout_s` (connect, prefill and answer together);
2. decode: the client's request unchanged but for the producer's `kv_transfer_params` copied
   in, to the decode instance the decode-room policy picks (pd_decode.py: load and KV room),
   with the forwarder's usual retries, streaming and relaying (proxy.py).

Nothing is lost when the first hop does not deliver: a prefill that fails (an error status, a
refused or broken connection), takes longer than the bound, or answers without
`kv_transfer_params` (an instance with no producer role, or vLLM's ExampleConnector, whose
consumer finds the KV by the prompt's tokens in its storage path: the decode hop is then the
client's request unchanged, as vLLM's toy proxy sends it) is abandoned (its connection closed:
the instance aborts it and frees its blocks) and the client's request goes to a decode instance
as a normal request, which prefills it itself. Each fallback is logged and counted by reason
(pd_metrics.py); a prefill instance that timed out is ejected for a while, one that refused
the connection is marked down, as for any backend. Other forwarded paths (/v1/responses) and
bodies that are not JSON objects go straight to a decode instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Sequence
from typing import Any

import httpx
from starlette.responses import Response

from pagedkv.router.backend import Backend
from pagedkv.router.pd_decode import DecodeRoomPolicy
from pagedkv.router.pd_metrics import PDMetrics
from pagedkv.router.pd_wire import decode_body, parse_object, prefill_body, transfer_params
from pagedkv.router.policies import Candidate, RouteRequest
from pagedkv.router.proxy import REQUEST_ID_HEADER, Forwarder, Pick
from pagedkv.router.relay import RelayResponse
from pagedkv.router.router import Router
from pagedkv.router.upstream import UpstreamAnswer, UpstreamError

logger = logging.getLogger("pagedkv.router")

PREFILL, DECODE = "prefill", "decode"
PD_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
DEFAULT_PREFILL_TIMEOUT_S = 30.0


def pd_backends(prefill: Sequence[str], decode: Sequence[str],
                events: Sequence[str | None] = ()) -> list[Backend]:
    """The backends of a prefill/decode fleet, prefill ones first, each with its role;
    `events` pairs with them in that order (empty: none publish). ValueError when a set is
    empty or a URL is in both."""
    if not prefill or not decode:
        raise ValueError("prefill/decode mode needs at least one --prefill and one --decode "
                         f"instance, got {len(prefill)} and {len(decode)}")
    both = {u.rstrip("/") for u in prefill} & {u.rstrip("/") for u in decode}
    if both:
        raise ValueError(f"{sorted(both)} given as both --prefill and --decode: an instance "
                         "takes one role")
    urls = [(u, PREFILL) for u in prefill] + [(u, DECODE) for u in decode]
    endpoints = list(events) or [None] * len(urls)
    if len(endpoints) != len(urls):
        raise ValueError(f"--kv-events is given {len(endpoints)} times for {len(urls)} "
                         "instances (prefill ones first, then decode); give one per instance")
    return [Backend(url, events_endpoint=ep, role=role)
            for (url, role), ep in zip(urls, endpoints, strict=True)]


class PDMode:
    """The router's prefill/decode split: which backends take which hop, the prefill bound,
    the decode policy and the metrics (registered in the router's registry)."""

    def __init__(self, router: Router, *, prefill_timeout_s: float = DEFAULT_PREFILL_TIMEOUT_S,
                 decode_policy: DecodeRoomPolicy | None = None) -> None:
        if not (prefill_timeout_s > 0 and math.isfinite(prefill_timeout_s)):
            raise ValueError(f"prefill_timeout_s must be a positive number of seconds, got "
                             f"{prefill_timeout_s!r}")
        self.prefill = frozenset(b.name for b in router.backends if b.role == PREFILL)
        self.decode = frozenset(b.name for b in router.backends if b.role == DECODE)
        if not self.prefill or not self.decode or \
                len(self.prefill) + len(self.decode) != len(router.backends):
            raise ValueError("prefill/decode mode needs every backend to be a prefill or a "
                             "decode instance, and at least one of each")
        self.router = router
        self.prefill_timeout_s = prefill_timeout_s
        self.decode_policy = decode_policy or DecodeRoomPolicy()
        self.metrics = PDMetrics(router.metrics.registry)
        self._warned_no_params: set[str] = set()

    def pick_prefill(self, request: RouteRequest) -> tuple[Backend, Candidate] | None:
        """The prefill instance for `request` (the router's policy over the prefill set)."""
        return self.router.route(request, exclude=self.decode)

    def decode_pick(self, transfer: bool) -> Pick:
        """The forwarder's pick over the decode set (decode-room), counting each hop."""
        def pick(request: RouteRequest, tried: list[str]) -> tuple[Backend, Candidate] | None:
            picked = self.router.route(request, exclude=self.prefill | set(tried),
                                       policy=self.decode_policy)
            if picked is not None:
                self.metrics.decodes.labels(picked[0].name, "yes" if transfer else "no").inc()
            return picked
        return pick

    def fell_back(self, reason: str, backend: str | None) -> None:
        """Count and log one request sent to decode as a normal request."""
        self.metrics.fallbacks.labels(reason).inc()
        where = f" on {backend}" if backend else ""
        if reason != "no_params":
            logger.warning("prefill%s failed (%s): the request decodes as a normal request",
                           where, reason)
        elif backend not in self._warned_no_params:  # a steady state: said once per instance
            self._warned_no_params.add(backend or "")
            logger.warning("prefill%s answered without kv_transfer_params (no producer role, "
                           "or a connector whose consumer finds the KV by the prompt itself, "
                           "as vLLM's ExampleConnector): its requests go to decode as the "
                           "client sent them", where)


class PDForwarder(Forwarder):
    """A `Forwarder` that runs the two hops above for /v1/completions and
    /v1/chat/completions."""

    def __init__(self, router: Router, client: httpx.AsyncClient, pd: PDMode,
                 **kwargs: Any) -> None:
        super().__init__(router, client, **kwargs)
        self.pd = pd

    async def _place(self, request: RouteRequest, path: str, body: bytes, stream: bool,
                     headers: dict[str, str] | None = None,
                     pick: Pick | None = None) -> Response | RelayResponse:
        headers = self.headers if headers is None else headers
        parsed = parse_object(body) if path in PD_PATHS else None
        if parsed is None:
            return await super()._place(request, path, body, stream, headers,
                                        self.pd.decode_pick(False))
        if REQUEST_ID_HEADER not in headers:  # one id for both hops, as vLLM's proxy sends
            headers = {**headers, REQUEST_ID_HEADER: f"pd-{uuid.uuid4().hex}"}
        params = await self._prefill(request, path, parsed, headers)
        decode = body if params is None else decode_body(parsed, params)
        return await super()._place(request, path, decode, stream, headers,
                                    self.pd.decode_pick(params is not None))

    async def _prefill(self, request: RouteRequest, path: str, parsed: dict[str, Any],
                       headers: dict[str, str]) -> dict[str, Any] | None:
        """The producer's kv_transfer_params for `parsed`, or None (a fallback, counted)."""
        picked = self.pd.pick_prefill(request)
        if picked is None:
            self.pd.fell_back("no_prefill_instance", None)
            return None
        backend, candidate = picked
        ticket = self.router.begin(backend, request, candidate)
        started = time.monotonic()
        answer: UpstreamAnswer | None = None
        params = None
        try:
            async with asyncio.timeout(self.pd.prefill_timeout_s):
                answer = await self.upstream.post(backend.url + path,
                                                  prefill_body(parsed, path), headers)
                content = await answer.read()
            params = transfer_params(content) if answer.status_code == 200 else None
            outcome = ("ok" if params is not None else
                       "no_params" if answer.status_code == 200 else
                       f"status_{answer.status_code}")
            if answer.status_code < 500:
                self.router.record_success(backend)
        except TimeoutError:
            outcome = "timeout"
            self.router.eject(backend, f"prefill took over {self.pd.prefill_timeout_s:g} s")
        except UpstreamError as exc:
            outcome = "connect" if answer is None else "read"
            self.router.mark_down(backend, f"prefill failed: {exc}")
        finally:
            ticket.end()
            if answer is not None:
                with contextlib.suppress(Exception):
                    await answer.aclose()
        self.pd.metrics.prefill_seconds.labels(backend.name).observe(time.monotonic() - started)
        self.pd.metrics.prefills.labels(backend.name, outcome).inc()
        if params is None:
            self.pd.fell_back(outcome, backend.name)
        return params
