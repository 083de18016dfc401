"""The health checker: every `interval_s`, each backend's /health and its load gauges from
/metrics (asked for by name, `LOAD_QUERY`: the backend renders those three gauges instead of
every histogram it keeps); every `info_interval_s`, and whenever a backend comes (back) up,
its /kv_cache_info and /v1/models, which change only when the backend restarts (and a restart
is seen: its connections are refused meanwhile, so it is down first).

A backend that answers /health with 200 is marked up (its hashing settings and models as last
fetched: the router sends a request only to backends serving its model, and counts prefixes
only where the settings match and prefix caching is on). One that refuses the connection is
marked down at once, which drops its prefix index; one that times out or answers anything but
200 is marked down after `failure_threshold` such rounds in a row (a busy backend answers
slowly; it is not dead). A failed /metrics scrape keeps the last load. Requests that fail to
connect mark a backend down at once as well (proxy.py); this loop is what brings it back. The
requests go through an `Upstream` (raw_upstream.py in `pagedkv router`: a round costs two
small requests per backend).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from urllib.parse import urlencode

import httpx
import pydantic

from pagedkv.http.protocol import ModelCard
from pagedkv.router.backend import LOAD_QUERY, Backend, parse_load
from pagedkv.router.router import Router
from pagedkv.router.upstream import HttpxUpstream, Upstream, UpstreamError

logger = logging.getLogger("pagedkv.router")

KV_INFO_ROUTE = "/kv_cache_info"
METRICS_ROUTE = "/metrics?" + urlencode(LOAD_QUERY, doseq=True)
DEFAULT_INFO_INTERVAL_S = 10.0


class _Answer:
    """A backend's answer read whole."""

    def __init__(self, status_code: int, content: bytes) -> None:
        self.status_code = status_code
        self.content = content

    def json(self) -> object:
        return json.loads(self.content)


class HealthChecker:
    """Polls the router's backends through `client` (an `Upstream`, or an httpx client);
    `timeout_s` bounds each request. `headers` go with the /v1/models request (the backends'
    API key). `info_interval_s` 0 fetches /kv_cache_info and /v1/models every round."""

    def __init__(self, router: Router, client: httpx.AsyncClient | Upstream, *,
                 interval_s: float = 1.0, timeout_s: float = 2.0, failure_threshold: int = 3,
                 headers: dict[str, str] | None = None,
                 info_interval_s: float = DEFAULT_INFO_INTERVAL_S) -> None:
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError(f"health interval and timeout must be positive, got "
                             f"{interval_s!r} and {timeout_s!r}")
        if not info_interval_s >= 0:
            raise ValueError(f"info_interval_s must be >= 0, got {info_interval_s!r}")
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold!r}")
        self.router = router
        self.upstream = HttpxUpstream(client) if isinstance(client, httpx.AsyncClient) else client
        self.info_interval_s = info_interval_s
        self._info_at: dict[str, float] = {}  # when each backend's info was last fetched
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failure_threshold = failure_threshold
        self.headers = dict(headers or {})
        self._failures: dict[str, int] = {}

    async def check(self, backend: Backend) -> bool:
        """One round for one backend; True when it is up afterwards."""
        try:
            health = await self._get(backend.url + "/health")
            if health.status_code != 200:
                return self._failed(backend, f"/health answered {health.status_code}")
            if self._info_due(backend):
                await self._refresh_kv_info(backend)
                await self._refresh_models(backend)
                self._info_at[backend.name] = time.monotonic()
        except UpstreamError as exc:
            if not exc.connected:
                return self._failed(backend, f"connection refused: {exc}", at_once=True)
            return self._failed(backend, f"health check failed: {exc}")
        except (TimeoutError, ValueError) as exc:
            return self._failed(backend, f"health check failed: {exc!r}")
        self._failures[backend.name] = 0
        self.router.mark_up(backend)
        await self._scrape_load(backend)
        return True

    async def _get(self, url: str, headers: dict[str, str] | None = None) -> _Answer:
        """GET `url`, read whole within the timeout (TimeoutError past it)."""
        async with asyncio.timeout(self.timeout_s):
            answer = await self.upstream.get(url, headers)
            try:
                return _Answer(answer.status_code, await answer.read())
            finally:
                await answer.aclose()

    def _info_due(self, backend: Backend) -> bool:
        """True when its /kv_cache_info and /v1/models are to be fetched this round: it is not
        up (coming back: perhaps another build behind the same URL), or they are stale."""
        last = self._info_at.get(backend.name)
        return (not backend.up or last is None
                or time.monotonic() - last >= self.info_interval_s)

    def _failed(self, backend: Backend, reason: str, at_once: bool = False) -> bool:
        count = self._failures.get(backend.name, 0) + 1
        self._failures[backend.name] = count
        if at_once or count >= self.failure_threshold or not backend.up:
            self.router.mark_down(backend, reason)
        return backend.up

    async def _scrape_load(self, backend: Backend) -> None:
        try:
            metrics = await self._get(backend.url + METRICS_ROUTE)
            if metrics.status_code == 200:
                backend.load = parse_load(metrics.content.decode("utf-8", "replace"))
        except (UpstreamError, TimeoutError, ValueError) as exc:
            logger.debug("cannot scrape %s/metrics: %r", backend.url, exc)

    async def _refresh_models(self, backend: Backend) -> None:
        """Its /v1/models cards (unreadable cards left out); a failed fetch keeps the last."""
        resp = await self._get(backend.url + "/v1/models", self.headers)
        if resp.status_code != 200:
            logger.warning("%s/v1/models answered %d; its models stay %s", backend.url,
                           resp.status_code, sorted(backend.models or ()))
            return
        try:
            data = resp.json()
        except ValueError:
            logger.warning("%s/v1/models answered no JSON; its models stay as they were",
                           backend.url)
            return
        raw_cards = data.get("data") if isinstance(data, dict) else None
        cards = []
        for raw in raw_cards if isinstance(raw_cards, list) else []:
            try:
                cards.append(ModelCard.model_validate(raw))
            except pydantic.ValidationError:
                continue  # a card we cannot read is left out
        self.router.set_models(backend, cards)

    async def _refresh_kv_info(self, backend: Backend) -> None:
        """Its /kv_cache_info applied: a 404 is a backend without one (vLLM); an error status
        or a body that is not JSON leaves it routable without prefix credit."""
        resp = await self._get(backend.url + KV_INFO_ROUTE)
        if resp.status_code == 404:
            self.router.set_kv_info(backend, None)
        elif resp.status_code != 200:
            self.router.kv_info_unusable(backend, f"{KV_INFO_ROUTE} answered {resp.status_code}")
        else:
            try:
                info = resp.json()
            except ValueError:
                self.router.kv_info_unusable(backend, f"{KV_INFO_ROUTE} answered no JSON")
                return
            self.router.set_kv_info(backend, info)

    async def check_all(self) -> int:
        """One round for every backend, concurrently; returns how many are up."""
        results = await asyncio.gather(*(self.check(b) for b in self.router.backends))
        return sum(results)

    async def run(self) -> None:
        """Check forever (cancel to stop)."""
        while True:
            try:
                await self.check_all()
                self.router.index.prune()
            except Exception:  # never let one bad round stop the checks
                logger.exception("health check round failed")
            await asyncio.sleep(self.interval_s)
