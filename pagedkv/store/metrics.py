"""Prometheus families for the KV store's tiers, from `EngineStats.kv_store_tiers` snapshots.

Per tier (label `tier`: host, disk, redis): `pagedkv:kv_store_hits_total` and
`pagedkv:kv_store_misses_total` (blocks asked of that tier on loads),
`pagedkv:kv_store_read_bytes_total` / `pagedkv:kv_store_written_bytes_total` (bytes moved),
`pagedkv:kv_store_usage_bytes` and `pagedkv:kv_store_blocks` (what it holds; 0 for Redis, which
the server bounds), and the histograms `pagedkv:kv_store_load_seconds` (one tier read of a
request's blocks) and `pagedkv:kv_store_save_seconds` (one tier write of a step's blocks).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

_COUNTERS = (
    ("pagedkv:kv_store_hits", "KV blocks loaded from the tier.", "hits"),
    ("pagedkv:kv_store_misses", "KV blocks asked of the tier and not found there.", "misses"),
    ("pagedkv:kv_store_read_bytes", "Bytes of KV blocks read from the tier.", "bytes_read"),
    ("pagedkv:kv_store_written_bytes", "Bytes of KV blocks written to the tier.",
     "bytes_written"),
)
_GAUGES = (
    ("pagedkv:kv_store_usage_bytes", "Bytes the tier holds.", "used_bytes"),
    ("pagedkv:kv_store_blocks", "KV blocks the tier holds.", "num_blocks"),
)
_HISTOGRAMS = (
    ("pagedkv:kv_store_load_seconds", "Latency of one tier read of a request's blocks.",
     "load_seconds"),
    ("pagedkv:kv_store_save_seconds", "Latency of one tier write of a step's blocks.",
     "save_seconds"),
)


def kv_store_metrics(model_name: str, tiers: Iterable[dict]) -> Iterator[Metric]:
    """The families for the tier snapshots `tiers` (`TierStats.to_dict()`); none without tiers."""
    tiers = list(tiers)
    if not tiers:
        return
    labels = ["model_name", "tier"]
    for name, doc, key in _COUNTERS:
        family = CounterMetricFamily(name, doc, labels=labels)
        for tier in tiers:
            family.add_metric([model_name, tier["name"]], float(tier[key]))
        yield family
    for name, doc, key in _GAUGES:
        family = GaugeMetricFamily(name, doc, labels=labels)
        for tier in tiers:
            family.add_metric([model_name, tier["name"]], float(tier[key]))
        yield family
    for name, doc, key in _HISTOGRAMS:
        family = HistogramMetricFamily(name, doc, labels=labels)
        for tier in tiers:
            hist = tier[key]
            cumulative, buckets = 0, []
            for bound, count in zip([*hist["buckets"], float("inf")], hist["counts"],
                                    strict=True):
                cumulative += count
                buckets.append((str(bound) if bound != float("inf") else "+Inf", cumulative))
            family.add_metric([model_name, tier["name"]], buckets, hist["sum"])
        yield family
