"""The engine families vLLM 0.32 exports beyond the basic gauges and counters
(`vllm/v1/metrics/loggers.py`), computed from an `EngineStats` snapshot at scrape time:

- `iteration_tokens_total` (histogram: tokens computed per engine step, vLLM's buckets);
- `prompt_tokens_cached_total`, `prompt_tokens_by_source_total{source=local_compute|
  local_cache_hit|external_kv_transfer}`, `prompt_tokens_cached_by_source_total{source=device|
  host|p2p|disk|external_unspecified}`: device prefix-cache hits and tokens loaded from the KV
  store's tiers (host = the CPU tier, disk, Redis = external_unspecified);
- `external_prefix_cache_queries_total` / `_hits_total`: tokens asked of the KV store (the first
  tier sees every block a load asks for) and found in any tier;
- `num_requests_waiting_by_reason{reason=capacity|deferred}` (deferred: loading KV);
- `cache_config_info` (a gauge of 1 whose labels are the cache configuration).

Store tiers count blocks; tokens here are blocks x block size.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from pagedkv.engine.stats import ITERATION_TOKEN_BUCKETS, EngineStats

_SOURCE_OF_MEDIUM = {"CPU": "host", "DISK": "disk", "REDIS": "external_unspecified"}
CACHED_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")


def _counter(name: str, doc: str, labels: list[str], values: list[str],
             rows: dict[str, float] | float, extra_label: str | None = None) -> Metric:
    family = CounterMetricFamily(name, doc, labels=labels + ([extra_label] if extra_label else []))
    if isinstance(rows, dict):
        for key, value in rows.items():
            family.add_metric(values + [key], float(value))
    else:
        family.add_metric(values, float(rows))
    return family


def engine_families(prefix: str, labels: list[str], values: list[str], stats: EngineStats,
                    block_size: int, cache_info: dict[str, str]) -> Iterator[Metric]:
    """The families above under `prefix` (`vllm` or `pagedkv`) with `labels` = `values`."""
    counts = list(stats.iteration_token_counts) or [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
    cumulative, buckets = 0, []
    for bound, count in zip([*map(str, ITERATION_TOKEN_BUCKETS), "+Inf"], counts, strict=True):
        cumulative += count
        buckets.append((bound, float(cumulative)))
    hist = HistogramMetricFamily(f"{prefix}:iteration_tokens_total",
                                 "Histogram of number of tokens per engine_step.", labels=labels)
    hist.add_metric(values, buckets, float(stats.iteration_tokens_sum))
    yield hist

    tiers = list(stats.kv_store_tiers)
    external_hits = {source: 0.0 for source in CACHED_SOURCES}
    for tier in tiers:
        external_hits[_SOURCE_OF_MEDIUM.get(tier["medium"], "external_unspecified")] += (
            tier["hits"] * block_size)
    external = sum(external_hits.values())
    queries = (tiers[0]["hits"] + tiers[0]["misses"]) * block_size if tiers else 0
    device = float(stats.prefix_cache_hits)
    by_source = {"device": device, **{k: v for k, v in external_hits.items() if k != "device"}}
    yield _counter(f"{prefix}:prompt_tokens_cached", "Number of cached prompt tokens (local + "
                   "external).", labels, values, device + external)
    yield _counter(f"{prefix}:prompt_tokens_by_source", "Number of prompt tokens by source.",
                   labels, values, {"local_compute": max(stats.prompt_tokens - device - external, 0),
                                    "local_cache_hit": device, "external_kv_transfer": external},
                   "source")
    yield _counter(f"{prefix}:prompt_tokens_cached_by_source", "Prefix-cache hit tokens by the "
                   "cache tier that supplied them.", labels, values, by_source, "source")
    yield _counter(f"{prefix}:external_prefix_cache_queries", "External prefix cache queries "
                   "(the KV store's tiers), in tokens.", labels, values, queries)
    yield _counter(f"{prefix}:external_prefix_cache_hits", "External prefix cache hits (the KV "
                   "store's tiers), in tokens.", labels, values, external)

    waiting = GaugeMetricFamily(f"{prefix}:num_requests_waiting_by_reason", "Number of waiting "
                                "requests by reason ('capacity': waiting for scheduling capacity; "
                                "'deferred': loading KV).", labels=labels + ["reason"])
    waiting.add_metric(values + ["capacity"], float(stats.num_waiting - stats.num_waiting_for_kv))
    waiting.add_metric(values + ["deferred"], float(stats.num_waiting_for_kv))
    yield waiting

    info = GaugeMetricFamily(f"{prefix}:cache_config_info",
                             "Information of the LLMEngine CacheConfig",
                             labels=[*cache_info, *(["engine"] if "engine" in labels else [])])
    info.add_metric([*cache_info.values(), *(values[labels.index("engine"):][:1]
                                              if "engine" in labels else [])], 1.0)
    yield info


def cache_config_info(engine: object) -> dict[str, str]:
    """vLLM's `CacheConfig.metrics_info()` keys that we have, as strings."""
    args = getattr(engine, "args", None)
    return {"block_size": str(getattr(args, "block_size", None)),
            "cache_dtype": str(getattr(args, "kv_cache_dtype", "auto")),
            "enable_prefix_caching": str(getattr(args, "enable_prefix_caching", True)),
            "gpu_memory_utilization": str(getattr(args, "gpu_memory_utilization", None)),
            "num_gpu_blocks": str(getattr(engine, "num_gpu_blocks", None)),
            "num_gpu_blocks_override": str(getattr(args, "num_gpu_blocks_override", None)),
            "prefix_caching_hash_algo": str(getattr(args, "prefix_caching_hash_algo", None)),
            "swap_space": str(getattr(args, "swap_space", None))}
