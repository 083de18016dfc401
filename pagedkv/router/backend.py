"""One backend (a `pagedkv serve` instance) as the router sees it.

Mutated only on the router's event loop: `up` by the health checker and by failed requests,
the scraped gauges and `model_cards` by the health checker, `in_flight`/`queued_blocks` by
`Router.begin` and the tickets it hands out, `written_blocks`/`written_at` by `Router.begin`,
`ejected_until`/`consecutive_failures` by `Router.eject` (a request it failed to answer in
time, or answered with garbage) and `Router.record_success`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pagedkv.router.policies.base import Candidate
from pagedkv.router.prefix_index import PrefixMatch

# The backend gauges the router reads (vLLM's names with pagedkv's prefix; vLLM's own as well).
RUNNING = ("pagedkv:num_requests_running", "vllm:num_requests_running")
WAITING = ("pagedkv:num_requests_waiting", "vllm:num_requests_waiting")
KV_USAGE = ("pagedkv:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
LOAD_GAUGES = RUNNING + WAITING + KV_USAGE
# The /metrics query asking for those alone (prometheus_client's `name[]` filter, which vLLM's
# and pagedkv's /metrics honour): the backend renders three gauges, not every histogram.
LOAD_QUERY = {"name[]": list(LOAD_GAUGES)}


@dataclass
class BackendLoad:
    """A backend's own load gauges, from its last /metrics scrape."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0


def parse_load(metrics_text: str) -> BackendLoad:
    """The load gauges in a Prometheus text exposition (missing ones read 0; samples of the
    same gauge, e.g. one per model, are summed; KV usage takes the largest). Only the gauges'
    own lines are parsed: a backend that ignores the `name[]` filter sends every family."""
    lines = [line for line in metrics_text.splitlines() if line.startswith(LOAD_GAUGES)]
    values: dict[str, float] = {}
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            if sample.name in KV_USAGE:
                values[sample.name] = max(values.get(sample.name, 0.0), sample.value)
            else:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value

    def first(names: tuple[str, ...]) -> float:
        return next((values[n] for n in names if n in values), 0.0)

    return BackendLoad(running=int(first(RUNNING)), waiting=int(first(WAITING)),
                       kv_usage=float(first(KV_USAGE)))


@dataclass
class Backend:
    """`url` is the base URL (no trailing slash); `name` labels it in metrics and policies.
    `events_endpoint` is its ZMQ KV-event endpoint, when it publishes events. `kv_info` is its
    /kv_cache_info answer (block size, hash algorithm, pool size), once fetched; until then (and
for a vLLM server, which has none) its events are also matched by their token ids."""

    url: str
    events_endpoint: str | None = None
    up: bool = False
    load: BackendLoad = field(default_factory=BackendLoad)
    in_flight: int = 0
    queued_blocks: float = 0.0
    kv_info: dict[str, Any] | None = None
    hash_compatible: bool = True  # same block size, prefix caching on: prefixes count
    native_hashes: bool = False  # its events' hashes are the router's (same algorithm too)
    kv_problem: str | None = None  # why its /kv_cache_info answer is unusable (kv_info.py)
    last_error: str | None = None
    model_cards: list[Any] | None = None  # its /v1/models cards (ModelCard); None: not known
    ejected_until: float = 0.0  # time.monotonic() before which no request is sent to it
    consecutive_failures: int = 0  # requests in a row it failed (timeouts, garbage answers)
    written_blocks: float = 0.0  # new blocks sent here, decaying (see `record_written`)
    written_at: float = 0.0  # time.monotonic() of written_blocks' value
    role: str | None = None  # "prefill" or "decode" in prefill/decode mode (pd.py), else None

    def written(self, now: float, window_s: float) -> float:
        """The new blocks sent here, each weighed exp(-age / window_s)."""
        return self.written_blocks * math.exp(-max(0.0, now - self.written_at) / window_s)

    def record_written(self, blocks: float, now: float, window_s: float) -> None:
        """Count `blocks` new blocks sent here at `now`. Mutates written_blocks/written_at."""
        self.written_blocks = self.written(now, window_s) + max(0.0, blocks)
        self.written_at = now

    def turnover(self, now: float, window_s: float) -> float:
        """`written` over its pool size: its caches' recent rewrite rate (0 while the pool size
        is unknown: a vLLM backend has no /kv_cache_info)."""
        pool = (self.kv_info or {}).get("num_gpu_blocks")
        if not isinstance(pool, int) or isinstance(pool, bool) or pool <= 0:
            return 0.0
        return self.written(now, window_s) / pool

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"backend URL must start with http:// or https://, got {self.url!r}")

    @property
    def name(self) -> str:
        return self.url

    @property
    def models(self) -> frozenset[str] | None:
        """The model ids it serves (from its /v1/models), None while not known."""
        if self.model_cards is None:
            return None
        return frozenset(card.id for card in self.model_cards)

    @property
    def only_model(self) -> str | None:
        """Its model when it serves exactly one (every `pagedkv serve` does), else None: the
        model its KV events and unnamed requests are indexed under."""
        models = self.models
        return next(iter(models)) if models is not None and len(models) == 1 else None

    def serves(self, model: str | None) -> bool:
        """True when a request for `model` may go here (None: a request naming no model)."""
        return model is None or (self.models is not None and model in self.models)

    def ejected(self, now: float) -> bool:
        return now < self.ejected_until

    def candidate(self, match: PrefixMatch, turnover: float = 0.0) -> Candidate:
        """A snapshot for the policies (`match`: the request's prefix on this backend)."""
        return Candidate(name=self.name, in_flight=self.in_flight,
                         queued_blocks=self.queued_blocks, running=self.load.running,
                         waiting=self.load.waiting, kv_usage=self.load.kv_usage, match=match,
                         turnover=turnover)
