"""The health checker: every `interval_s`, each backend's /health, /kv_cache_info, /v1/models
and its load gauges from /metrics (asked for by name, `LOAD_QUERY`: the backend renders those
three gauges instead of every histogram it keeps).

A backend that answers /health with 200 is marked up (its hashing settings, models and load
gauges refreshed each round: the router sends a request only to backends serving its model, and
counts prefixes only where the settings match and prefix caching is on). One that refuses the connection is marked down
at once, which drops its prefix index; one that times out or answers anything but 200 is marked
down after `failure_threshold` such rounds in a row (a busy backend answers slowly; it is not
dead). A failed /metrics scrape keeps the last load. Requests that fail to connect mark a
backend down at once as well (proxy.py); this loop is what brings it back.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import pydantic

from pagedkv.router.backend import LOAD_QUERY, Backend, parse_load
from pagedkv.router.router import Router
from pagedkv.server.protocol import ModelCard

logger = logging.getLogger("pagedkv.router")

KV_INFO_ROUTE = "/kv_cache_info"


class HealthChecker:
    """Polls the router's backends with `client` (whose timeouts bound each check); `headers`
    go with the /v1/models request (the backends' API key)."""

    def __init__(self, router: Router, client: httpx.AsyncClient, *, interval_s: float = 1.0,
                 timeout_s: float = 2.0, failure_threshold: int = 3,
                 headers: dict[str, str] | None = None) -> None:
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError(f"health interval and timeout must be positive, got "
                             f"{interval_s!r} and {timeout_s!r}")
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold!r}")
        self.router = router
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failure_threshold = failure_threshold
        self.headers = dict(headers or {})
        self._failures: dict[str, int] = {}

    async def check(self, backend: Backend) -> bool:
        """One round for one backend; True when it is up afterwards."""
        try:
            health = await self.client.get(backend.url + "/health", timeout=self.timeout_s)
            if health.status_code != 200:
                return self._failed(backend, f"/health answered {health.status_code}")
            self.router.set_kv_info(backend, await self._kv_info(backend))
            await self._refresh_models(backend)
        except httpx.ConnectError as exc:
            return self._failed(backend, f"connection refused: {exc!r}", at_once=True)
        except (httpx.HTTPError, ValueError) as exc:
            return self._failed(backend, f"health check failed: {exc!r}")
        self._failures[backend.name] = 0
        self.router.mark_up(backend)
        await self._scrape_load(backend)
        return True

    def _failed(self, backend: Backend, reason: str, at_once: bool = False) -> bool:
        count = self._failures.get(backend.name, 0) + 1
        self._failures[backend.name] = count
        if at_once or count >= self.failure_threshold or not backend.up:
            self.router.mark_down(backend, reason)
        return backend.up

    async def _scrape_load(self, backend: Backend) -> None:
        try:
            metrics = await self.client.get(backend.url + "/metrics", params=LOAD_QUERY,
                                            timeout=self.timeout_s)
            if metrics.status_code == 200:
                backend.load = parse_load(metrics.text)
        except (httpx.HTTPError, ValueError) as exc:
            logger.debug("cannot scrape %s/metrics: %r", backend.url, exc)

    async def _refresh_models(self, backend: Backend) -> None:
        """Its /v1/models cards (unreadable cards left out); a failed fetch keeps the last."""
        resp = await self.client.get(backend.url + "/v1/models", headers=self.headers,
                                     timeout=self.timeout_s)
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

    async def _kv_info(self, backend: Backend) -> dict | None:
        resp = await self.client.get(backend.url + KV_INFO_ROUTE, timeout=self.timeout_s)
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        info = resp.json()
        return info if isinstance(info, dict) else None

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
