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
first token, time per output token (its mean; vLLM's current name
`request_time_per_output_token_seconds` and the older `time_per_output_token_seconds`), every
inter-token gap, end-to-end latency, time queued before first scheduled, prefill, decode and
inference time, prompt and generation token counts, `n`, `max_tokens`, preemptions, prompt
tokens computed, and `request_success` by finish reason. `admission_rejections` counts 503s for
a full queue. `vllm_metrics.py` adds the engine families computed at scrape time.

Names, types, buckets and labels are vLLM 0.32's: every `vllm:` series carries
`engine="0"` besides `model_name` (`admission_rejections` and `cache_config_info` too); the
`pagedkv:` twins carry `model_name` only. With data parallelism (`update` given each core's
stats) the engine families' `vllm:` series come once per core, `engine="0"` .. `"N-1"`, as
vLLM's do, and their `pagedkv:` twins are the cores' sum (what a router reads as the server's
load); the request histograms stay `engine="0"` (the server's, over every core).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedkv.engine.stats import EngineStats, sum_stats
from pagedkv.server.batched_histogram import BatchedHistogram
from pagedkv.server.vllm_metrics import counter_family, engine_families
from pagedkv.store.metrics import kv_store_metrics

# vLLM's buckets (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

PREFIXES = ("pagedkv", "vllm")
ENGINE_INDEX = "0"  # vLLM's `engine` label: one engine core per server
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
N_BUCKETS = (1, 2, 5, 10, 20)
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's, all from 0


def label_names(prefix: str) -> list[str]:
    """The labels of `prefix`'s series: vLLM's carry the engine index too."""
    return ["model_name", "engine"] if prefix == "vllm" else ["model_name"]


def label_values(prefix: str, model_name: str, engine: str = ENGINE_INDEX) -> list[str]:
    return [model_name, engine] if prefix == "vllm" else [model_name]

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

    def __init__(self, model_name: str, block_size: int, cache_info: dict[str, str]) -> None:
        self.model_name = model_name
        self.block_size = block_size
        self.cache_info = cache_info
        self.stats = EngineStats()
        self.core_stats: list[EngineStats] = [self.stats]  # each engine core's, core 0 first
        self.created = time.time()  # the counters' `_created`, as prometheus_client's

    def _series(self, prefix: str) -> list[tuple[list[str], EngineStats]]:
        """(label values, stats) of each series of `prefix`: vLLM's one per engine core."""
        if prefix == "vllm":
            return [(label_values(prefix, self.model_name, str(i)), stats)
                    for i, stats in enumerate(self.core_stats)]
        return [(label_values(prefix, self.model_name), self.stats)]

    def collect(self) -> Iterator[Metric]:
        for prefix in PREFIXES:
            labels, series = label_names(prefix), self._series(prefix)
            for name, doc, attr in _GAUGES:
                gauge = GaugeMetricFamily(f"{prefix}:{name}", doc, labels=labels)
                for values, stats in series:
                    gauge.add_metric(values, float(getattr(stats, attr)))
                yield gauge
            for name, doc, attr in _COUNTERS:
                yield _merged([counter_family(f"{prefix}:{name}", doc, labels, values,
                                              float(getattr(stats, attr)), self.created)
                               for values, stats in series])
            for families in zip(*(engine_families(prefix, labels, values, stats,
                                                  self.block_size, self.cache_info,
                                                  self.created)
                                  for values, stats in series), strict=True):
                yield _merged(list(families))
        pinned = GaugeMetricFamily("pagedkv:kv_pinned_blocks",  # pagedkv's own: no vllm: twin
                                   "Device KV blocks held by pinned prefixes (/v1/pin).",
                                   labels=["model_name"])
        pinned.add_metric([self.model_name], float(self.stats.num_pinned_blocks))
        yield pinned
        yield from kv_store_metrics(self.model_name, self.stats.kv_store_tiers)


def _merged(families: list[Metric]) -> Metric:
    """One family holding the samples of these same-named families (one per engine core)."""
    first = families[0]
    for other in families[1:]:
        first.samples.extend(other.samples)
    return first


@dataclass(frozen=True)
class RequestPhases:
    """What vLLM's per-request histograms need beyond latency: the request's `n` and
    `max_tokens`, how often it was preempted, prompt tokens it computed (not cached), and the
    seconds from first scheduled to first token (prefill), first to last token (decode) and
    first scheduled to last token (inference); None when unknown."""

    n: int
    max_tokens: int | None
    num_preemptions: int
    num_computed_prompt_tokens: int
    prefill_time: float | None
    decode_time: float | None
    inference_time: float | None


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

    def __init__(self, model_name: str, max_model_len: int = 2048, block_size: int = 16,
                 cache_info: dict[str, str] | None = None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine = _EngineStatsCollector(model_name, block_size, cache_info or {})
        self.registry.register(self._engine)
        tokens = token_buckets(max_model_len)
        self.ttft = self._histogram("time_to_first_token_seconds",
                                    "Time to first token, from arrival.", TTFT_BUCKETS)
        self.tpot = _Both([*self._histogram(
            "time_per_output_token_seconds", "Mean time per output token after the first, per "
            "request (vLLM's older name).", TPOT_BUCKETS).children, *self._histogram(
            "request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds "
            "per request.", TPOT_BUCKETS).children])
        self.itl = BatchedHistogram(self._histogram(
            "inter_token_latency_seconds", "Time between consecutive output tokens.",
            TPOT_BUCKETS).children)
        self.e2e = self._histogram("e2e_request_latency_seconds", "End-to-end request latency.",
                                   E2E_BUCKETS)
        self.queue = self._histogram("request_queue_time_seconds",
                                     "Time from arrival to first scheduled.", E2E_BUCKETS)
        self.prompt_tokens = self._histogram("request_prompt_tokens",
                                             "Prompt tokens per request.", tokens)
        self.generation_tokens = self._histogram("request_generation_tokens",
                                                 "Generated tokens per request.", tokens)
        self.prefill_time = self._histogram("request_prefill_time_seconds", "Histogram of time "
                                            "spent in PREFILL phase for request.", E2E_BUCKETS)
        self.decode_time = self._histogram("request_decode_time_seconds", "Histogram of time "
                                           "spent in DECODE phase for request.", E2E_BUCKETS)
        self.inference_time = self._histogram("request_inference_time_seconds", "Histogram of "
                                              "time spent in RUNNING phase for request.",
                                              E2E_BUCKETS)
        self.max_generation_tokens = self._histogram(
            "request_max_num_generation_tokens", "Histogram of maximum number of requested "
            "generation tokens.", tokens)
        self.params_n = self._histogram("request_params_n", "Histogram of the n request "
                                        "parameter.", N_BUCKETS)
        self.params_max_tokens = self._histogram("request_params_max_tokens", "Histogram of the "
                                                 "max_tokens request parameter.", tokens)
        self.preemptions = self._histogram("request_num_preemptions", "Number of preemptions "
                                           "per request.", PREEMPTION_BUCKETS)
        self.kv_computed = self._histogram(
            "request_prefill_kv_computed_tokens", "Histogram of new KV tokens computed during "
            "prefill (excluding cached tokens).", tokens)
        self._success = {prefix: Counter(f"{prefix}:request_success",
                                         "Requests finished, by finish reason.",
                                         [*label_names(prefix), "finished_reason"],
                                         registry=self.registry)
                         for prefix in PREFIXES}
        for prefix, success in self._success.items():
            for reason in FINISHED_REASONS:
                success.labels(*label_values(prefix, model_name), reason)
        self._rejections = {prefix: Counter(f"{prefix}:admission_rejections", "Number of "
                                            "admission attempts rejected by a queue limit, by "
                                            "reason.", [*label_names(prefix), "reason"],
                                            registry=self.registry)
                            for prefix in PREFIXES}
        for prefix, counter in self._rejections.items():
            for reason in ADMISSION_REASONS:
                counter.labels(*label_values(prefix, model_name), reason)

    def _histogram(self, name: str, doc: str, buckets) -> _Both:
        return _Both([Histogram(f"{prefix}:{name}", doc, label_names(prefix), buckets=buckets,
                                registry=self.registry).labels(*label_values(prefix,
                                                                             self.model_name))
                      for prefix in PREFIXES])

    def admission_rejected(self, reason: str = "max_num_queued_reqs") -> None:
        """A request refused (503) because the queue was full."""
        for prefix, counter in self._rejections.items():
            counter.labels(*label_values(prefix, self.model_name), reason).inc()

    def update(self, stats: EngineStats | Sequence[EngineStats]) -> None:
        """The engine's stats now: one `EngineStats`, or each engine core's (data parallel)."""
        if isinstance(stats, EngineStats):
            stats = [stats]
        self._engine.core_stats = list(stats)
        self._engine.stats = stats[0] if len(stats) == 1 else sum_stats(stats)

    def observe_request(self, *, ttft: float | None, e2e: float, num_output_tokens: int,
                        num_prompt_tokens: int | None = None, finished_reason: str = "stop",
                        queue_time: float | None = None,
                        phases: RequestPhases | None = None) -> None:
        """Record a finished request: time to first token (None if it produced none),
        end-to-end latency, the output length of its longest sequence, its prompt length, why
        it finished, how long it queued (None when unknown) and its `phases`."""
        self.e2e.observe(e2e)
        _Both([c.labels(*label_values(prefix, self.model_name), finished_reason)
               for prefix, c in self._success.items()]).inc()
        if phases is not None:
            self._observe_phases(phases, num_output_tokens)
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

    def _observe_phases(self, phases: RequestPhases, num_output_tokens: int) -> None:
        self.params_n.observe(phases.n)
        if phases.max_tokens is not None:
            self.params_max_tokens.observe(phases.max_tokens)
        self.max_generation_tokens.observe(num_output_tokens)
        self.preemptions.observe(phases.num_preemptions)
        self.kv_computed.observe(phases.num_computed_prompt_tokens)
        for histogram, value in ((self.prefill_time, phases.prefill_time),
                                 (self.decode_time, phases.decode_time),
                                 (self.inference_time, phases.inference_time)):
            if value is not None:
                histogram.observe(max(value, 0.0))

    def observe_inter_token(self, gap: float, num_tokens: int = 1) -> None:
        """`num_tokens` tokens arrived `gap` seconds after the previous ones: one observation
        of gap / num_tokens per token."""
        self.itl.observe(gap / num_tokens, num_tokens)

    def render(self, names: Iterable[str] | None = None) -> bytes:
        """The exposition of every family, or of the samples called `names` only."""
        self.itl.flush()
        registry = self.registry if names is None else self.registry.restricted_registry(names)
        return generate_latest(registry)
