"""Prometheus metrics mirroring vLLM's, with the `pagedkv:` prefix, in a per-app registry.

Gauges and counters come from the engine's own `EngineStats` (read fresh by the loop thread on
each scrape, so an abort shows up at once); the three latency histograms are observed by the
server as requests finish. Nothing lives in prometheus_client's global registry, so two apps
(two engines) can live in one process.

`pagedkv:kv_cache_usage_perc` is a fraction in [0, 1] (as vLLM's is, despite the name): the
share of usable device blocks that requests hold; cached blocks no request holds count as free.
Prefix-cache queries and hits count tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedkv.engine.stats import EngineStats
from pagedkv.store.metrics import kv_store_metrics

# vLLM's buckets (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

_GAUGES = (
    ("pagedkv:num_requests_running", "Number of requests in the running batch.", "num_running"),
    ("pagedkv:num_requests_waiting", "Number of requests waiting to be scheduled.", "num_waiting"),
    ("pagedkv:num_requests_swapped", "Number of requests swapped out to host memory.",
     "num_swapped"),
    ("pagedkv:kv_cache_usage_perc", "Fraction of KV cache blocks held by requests (0 to 1).",
     "kv_cache_usage"),
)
_COUNTERS = (
    ("pagedkv:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    ("pagedkv:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("pagedkv:num_preemptions", "Cumulative number of preemptions.", "num_preemptions"),
    ("pagedkv:num_swaps", "Cumulative number of preemptions by swap to host memory.",
     "num_swaps"),
    ("pagedkv:prompt_tokens", "Prompt tokens processed (prefill).", "prompt_tokens"),
    ("pagedkv:generation_tokens", "Tokens generated.", "generation_tokens"),
)


class _EngineStatsCollector(Collector):
    """Exposes the last `EngineStats` handed to `update` as gauges and counters."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats = EngineStats()

    def collect(self) -> Iterator[Metric]:
        for name, doc, attr in _GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric([self.model_name], float(getattr(self.stats, attr)))
            yield gauge
        for name, doc, attr in _COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric([self.model_name], float(getattr(self.stats, attr)))
            yield counter
        yield from kv_store_metrics(self.model_name, self.stats.kv_store_tiers)


class ServerMetrics:
    """The metrics of one app: `update(stats)` then `render()` on each scrape;
    `observe_request(...)` when a request finishes."""

    content_type = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine = _EngineStatsCollector(model_name)
        self.registry.register(self._engine)
        labels = ["model_name"]
        self.ttft = Histogram("pagedkv:time_to_first_token_seconds",
                              "Time to first token, from arrival.", labels,
                              buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.tpot = Histogram("pagedkv:time_per_output_token_seconds",
                              "Time per output token after the first.", labels,
                              buckets=TPOT_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("pagedkv:e2e_request_latency_seconds",
                             "End-to-end request latency.", labels,
                             buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)

    def update(self, stats: EngineStats) -> None:
        self._engine.stats = stats

    def observe_request(self, *, ttft: float | None, e2e: float, num_output_tokens: int) -> None:
        """Record a finished request: time to first token (None if it produced none),
        end-to-end latency and the output length of its longest sequence."""
        self.e2e.observe(e2e)
        if ttft is None:
            return
        self.ttft.observe(ttft)
        if num_output_tokens > 1:
            self.tpot.observe((e2e - ttft) / (num_output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
