"""The engine families vLLM 0.32 exports beyond the basic gauges and counters
(`vllm/v1/metrics/loggers.py`), computed from an `EngineStats` snapshot at scrape time:

- `iteration_tokens_total` (histogram: tokens computed per engine step, vLLM's buckets);
- `prompt_tokens_cached_total`, `prompt_tokens_by_source_total{source=local_compute|
  local_cache_hit|external_kv_transfer}`, `prompt_tokens_cached_by_source_total{source=device|
  host|p2p|disk|external_unspecified}`: device prefix-cache hits and tokens loaded from the KV
  store's tiers (host = the CPU tier, disk, Redis = external_unspecified);
- `external_prefix_cache_queries_total` / `_hits_total`: tokens asked of the KV store (the first
  tier sees every block a load asks for) and found in any tier;
- `spec_decode_num_drafts_total`, `_num_draft_tokens_total`, `_num_accepted_tokens_total`,
  `_num_accepted_tokens_per_pos_total{position=0..k-1}` (only with speculative decoding);
- `num_requests_waiting_by_reason{reason=capacity|deferred}` (deferred: loading KV);
- `cache_config_info` (a gauge of 1 whose labels are the cache configuration, model and engine);
- `engine_sleep_state{sleep_state=awake|weights_offloaded|discard_all}` (always awake: no sleep
  mode here) and `mm_cache_queries_total` / `_hits_total` (always 0: no multimodal inputs),
  so dashboards built on them find them.

Counters and the histogram carry a `_created` sample (the collector's start), as
prometheus_client's own counters and vLLM's do; bucket bounds are written as floats ("1.0").

Store tiers count blocks; tokens here are blocks x block size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from pagedkv.engine.stats import ITERATION_TOKEN_BUCKETS, EngineStats

if TYPE_CHECKING:
    from pagedkv.server.engine_facts import EngineFacts

_SOURCE_OF_MEDIUM = {"CPU": "host", "DISK": "disk", "REDIS": "external_unspecified"}
CACHED_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


def counter_family(name: str, doc: str, labels: list[str], values: list[str],
            rows: dict[str, float] | float, created: float,
            extra_label: str | None = None) -> Metric:
    """A counter family of one series (`rows` a number) or one per `extra_label` value (`rows`
    a dict), each with its `_created` sample."""
    family = CounterMetricFamily(name, doc, labels=labels + ([extra_label] if extra_label else []))
    if isinstance(rows, dict):
        for key, value in rows.items():
            family.add_metric(values + [key], float(value), created=created)
    else:
        family.add_metric(values, float(rows), created=created)
    return family


def engine_families(prefix: str, labels: list[str], values: list[str], stats: EngineStats,
                    block_size: int, cache_info: dict[str, str],
                    created: float) -> Iterator[Metric]:
    """The families above under `prefix` (`vllm` or `pagedkv`) with `labels` = `values`;
    `created`: the `_created` timestamp of the counters and the histogram."""
    yield _iteration_tokens(prefix, labels, values, stats, created)

    tiers = list(stats.kv_store_tiers)
    external_hits = {source: 0.0 for source in CACHED_SOURCES}
    for tier in tiers:
        external_hits[_SOURCE_OF_MEDIUM.get(tier["medium"], "external_unspecified")] += (
            tier["hits"] * block_size)
    external = sum(external_hits.values())
    queries = (tiers[0]["hits"] + tiers[0]["misses"]) * block_size if tiers else 0
    device = float(stats.prefix_cache_hits)
    by_source = {"device": device, **{k: v for k, v in external_hits.items() if k != "device"}}
    def count(name: str, doc: str, rows: dict[str, float] | float,
              extra_label: str | None = None) -> Metric:
        return counter_family(f"{prefix}:{name}", doc, labels, values, rows, created,
                              extra_label)

    yield count("prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
                device + external)
    yield count("prompt_tokens_by_source", "Number of prompt tokens by source.",
                {"local_compute": max(stats.prompt_tokens - device - external, 0),
                 "local_cache_hit": device, "external_kv_transfer": external}, "source")
    yield count("prompt_tokens_cached_by_source", "Prefix-cache hit tokens by the cache tier "
                "that supplied them.", by_source, "source")
    yield count("external_prefix_cache_queries", "External prefix cache queries (the KV "
                "store's tiers), in tokens.", queries)
    yield count("external_prefix_cache_hits", "External prefix cache hits (the KV store's "
                "tiers), in tokens.", external)
    yield from _spec_decode(count, stats)
    yield count("mm_cache_queries", "Multi-modal cache queries, in terms of number of queried "
                "items (none here: text only).", 0.0)
    yield count("mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items "
                "(none here: text only).", 0.0)
    sleep = GaugeMetricFamily(f"{prefix}:engine_sleep_state", "Engine sleep state; awake = 0 "
                              "means engine is sleeping; awake = 1 means engine is awake; "
                              "weights_offloaded = 1 means sleep level 1; discard_all = 1 means "
                              "sleep level 2.", labels=labels + ["sleep_state"])
    for state in SLEEP_STATES:  # no sleep mode here: always awake
        sleep.add_metric(values + [state], 1.0 if state == "awake" else 0.0)
    yield sleep

    waiting = GaugeMetricFamily(f"{prefix}:num_requests_waiting_by_reason", "Number of waiting "
                                "requests by reason ('capacity': waiting for scheduling capacity; "
                                "'deferred': loading KV).", labels=labels + ["reason"])
    waiting.add_metric(values + ["capacity"], float(stats.num_waiting - stats.num_waiting_for_kv))
    waiting.add_metric(values + ["deferred"], float(stats.num_waiting_for_kv))
    yield waiting

    info = GaugeMetricFamily(f"{prefix}:cache_config_info",
                             "Information of the LLMEngine CacheConfig",
                             labels=[*cache_info, *labels])  # and model_name, engine (vLLM 0.32)
    info.add_metric([*cache_info.values(), *values], 1.0)
    yield info


def _spec_decode(count: Callable[..., Metric], stats: EngineStats) -> Iterator[Metric]:
    """vLLM's spec_decode_* counters (nothing without speculative decoding)."""
    if not stats.spec_decode_accepted_per_pos:
        return
    yield count("spec_decode_num_drafts", "Number of spec decoding drafts.",
                stats.spec_decode_num_drafts)
    yield count("spec_decode_num_draft_tokens", "Number of draft tokens.",
                stats.spec_decode_num_draft_tokens)
    yield count("spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                stats.spec_decode_num_accepted_tokens)
    yield count("spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                {str(i): n for i, n in enumerate(stats.spec_decode_accepted_per_pos)},
                "position")


def _iteration_tokens(prefix: str, labels: list[str], values: list[str], stats: EngineStats,
                      created: float) -> Metric:
    """vLLM's `iteration_tokens_total` histogram (bounds written as floats, as vLLM's)."""
    counts = list(stats.iteration_token_counts) or [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
    bounds = [*(floatToGoString(b) for b in ITERATION_TOKEN_BUCKETS), "+Inf"]
    cumulative, buckets = 0, []
    for bound, count in zip(bounds, counts, strict=True):
        cumulative += count
        buckets.append((bound, float(cumulative)))
    name = f"{prefix}:iteration_tokens_total"
    hist = HistogramMetricFamily(name, "Histogram of number of tokens per engine_step.",
                                 labels=labels)
    hist.add_metric(values, buckets, float(stats.iteration_tokens_sum))
    hist.samples.append(Sample(f"{name}_created", dict(zip(labels, values, strict=True)), created))
    return hist


def cache_config_info(facts: EngineFacts) -> dict[str, str]:
    """vLLM's `CacheConfig.metrics_info()` keys that we have, as strings."""
    args = facts.args
    return {"block_size": str(args.block_size),
            "cache_dtype": str(args.kv_cache_dtype),
            "enable_prefix_caching": str(args.enable_prefix_caching),
            "gpu_memory_utilization": str(args.gpu_memory_utilization),
            "num_gpu_blocks": str(facts.ready.num_gpu_blocks),
            "num_gpu_blocks_override": str(args.num_gpu_blocks_override),
            "prefix_caching_hash_algo": str(args.prefix_caching_hash_algo),
            "swap_space": str(args.swap_space)}
