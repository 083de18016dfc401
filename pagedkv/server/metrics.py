"""Prometheus metrics mirroring vLLM's, in a per-app registry, each under two names: with our
`pagedkv:` prefix and with vLLM's `vllm:` (so dashboards, autoscalers and KV-aware routers built
for vLLM work unchanged).

Gauges and counters come from the engine's own `EngineStats` (read fresh by the loop thread on
each scrape, so an abort shows up at once); the three latency histograms are observed by the
server as requests finish. Nothing lives in prometheus_client's global registry, so two apps
(two engines) can live in one process.

`pagedkv:kv_cache_usage_perc` is a fraction in [0, 1] (as vLLM's is, despite the name): the
share of usable device blocks that requests hold; cached blocks no request holds count as free.
Prefix-cache queries and hits count tokens. Per finished request (stop or length): time to
first token, time per output token (its mean), every inter-token gap, end-to-end latency, time
queued before first scheduled, prompt and generation token counts, and `request_success` by
finish reason.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
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

PREFIXES = ("pagedkv", "vllm")

_GAUGES = (
    ("num_requests_running", "Number of requests in the running batch.", "num_running"),
    ("num_requests_waiting", "Number of requests waiting to be scheduled.", "num_waiting"),
    ("num_requests_swapped", "Number of requests swapped out to host memory.",
     "num_swapped"),
    ("kv_cache_usage_perc", "Fraction of KV cache blocks held by requests (0 to 1).",
     "kv_cache_usage"),
)
_COUNTERS = (
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("num_preemptions", "Cumulative number of preemptions.", "num_preemptions"),
    ("num_swaps", "Cumulative number of preemptions by swap to host memory.", "num_swaps"),
    ("prompt_tokens", "Prompt tokens processed (prefill).", "prompt_tokens"),
    ("generation_tokens", "Tokens generated.", "generation_tokens"),
)


def token_buckets(max_model_len: int) -> list[int]:
    """vLLM's 1-2-5 buckets up to `max_model_len` (token-count histograms)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class _EngineStatsCollector(Collector):
    """Exposes the last `EngineStats` handed to `update` as gauges and counters (both names)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats = EngineStats()

    def collect(self) -> Iterator[Metric]:
        for prefix in PREFIXES:
            for name, doc, attr in _GAUGES:
                gauge = GaugeMetricFamily(f"{prefix}:{name}", doc, labels=["model_name"])
                gauge.add_metric([self.model_name], float(getattr(self.stats, attr)))
                yield gauge
            for name, doc, attr in _COUNTERS:
                counter = CounterMetricFamily(f"{prefix}:{name}", doc, labels=["model_name"])
                counter.add_metric([self.model_name], float(getattr(self.stats, attr)))
                yield counter
        pinned = GaugeMetricFamily("pagedkv:kv_pinned_blocks",  # pagedkv's own: no vllm: twin
                                   "Device KV blocks held by pinned prefixes (/v1/pin).",
                                   labels=["model_name"])
        pinned.add_metric([self.model_name], float(self.stats.num_pinned_blocks))
        yield pinned
        yield from kv_store_metrics(self.model_name, self.stats.kv_store_tiers)


class _Both:
    """One metric registered under each prefix; `observe` / `inc` update every copy."""

    def __init__(self, children: list) -> None:
        self.children = children

    def observe(self, value: float) -> None:
        for child in self.children:
            child.observe(value)

    def inc(self) -> None:
        for child in self.children:
            child.inc()


class ServerMetrics:
    """The metrics of one app: `update(stats)` then `render()` on each scrape;
    `observe_request(...)` when a request finishes, `observe_inter_token(...)` as tokens come."""

    content_type = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, model_name: str, max_model_len: int = 2048) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine = _EngineStatsCollector(model_name)
        self.registry.register(self._engine)
        tokens = token_buckets(max_model_len)
        self.ttft = self._histogram("time_to_first_token_seconds",
                                    "Time to first token, from arrival.", TTFT_BUCKETS)
        self.tpot = self._histogram("time_per_output_token_seconds",
                                    "Mean time per output token after the first, per request.",
                                    TPOT_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds",
                                   "Time between consecutive output tokens.", TPOT_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "End-to-end request latency.",
                                   E2E_BUCKETS)
        self.queue = self._histogram("request_queue_time_seconds",
                                     "Time from arrival to first scheduled.", E2E_BUCKETS)
        self.prompt_tokens = self._histogram("request_prompt_tokens",
                                             "Prompt tokens per request.", tokens)
        self.generation_tokens = self._histogram("request_generation_tokens",
                                                 "Generated tokens per request.", tokens)
        self._success = {prefix: Counter(f"{prefix}:request_success",
                                         "Requests finished, by finish reason.",
                                         ["model_name", "finished_reason"], registry=self.registry)
                         for prefix in PREFIXES}

    def _histogram(self, name: str, doc: str, buckets) -> _Both:
        return _Both([Histogram(f"{prefix}:{name}", doc, ["model_name"], buckets=buckets,
                                registry=self.registry).labels(self.model_name)
                      for prefix in PREFIXES])

    def update(self, stats: EngineStats) -> None:
        self._engine.stats = stats

    def observe_request(self, *, ttft: float | None, e2e: float, num_output_tokens: int,
                        num_prompt_tokens: int | None = None, finished_reason: str = "stop",
                        queue_time: float | None = None) -> None:
        """Record a finished request: time to first token (None if it produced none),
        end-to-end latency, the output length of its longest sequence, its prompt length, why
        it finished and how long it queued (None when unknown)."""
        self.e2e.observe(e2e)
        _Both([c.labels(self.model_name, finished_reason)
               for c in self._success.values()]).inc()
        self.generation_tokens.observe(num_output_tokens)
        if num_prompt_tokens is not None:
            self.prompt_tokens.observe(num_prompt_tokens)
        if queue_time is not None:
            self.queue.observe(max(queue_time, 0.0))
        if ttft is None:
            return
        self.ttft.observe(ttft)
        if num_output_tokens > 1:
            self.tpot.observe((e2e - ttft) / (num_output_tokens - 1))

    def observe_inter_token(self, gap: float, num_tokens: int = 1) -> None:
        """`num_tokens` tokens arrived `gap` seconds after the previous ones: one observation
        of gap / num_tokens per token."""
        for _ in range(num_tokens):
            self.itl.observe(gap / num_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
