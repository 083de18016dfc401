"""The KV store's per-tier metrics on /metrics match the store's own counters."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagedkv.server.metrics import ServerMetrics
from tests.store.conftest import make_prefixes, run_one, store_llm, with_suffix


def test_tier_metrics_are_exported(tiny_llama, tmp_path):
    llm = store_llm(tiny_llama, "disk", tmp_path, kv_offloading_size=0.01)
    prefixes = make_prefixes(seed=21, num=3)
    for round_ in range(2):
        for i, prefix in enumerate(prefixes):
            run_one(llm, with_suffix(prefix, seed=10 * round_ + i))
    stats = llm.llm_engine.get_stats()
    assert [t["name"] for t in stats.kv_store_tiers] == ["host", "disk"]
    host, disk = stats.kv_store_tiers
    assert host["hits"] == 30 and disk["hits"] == 0  # the host tier served every block
    assert disk["bytes_written"] == host["bytes_written"] > 0  # written through
    assert disk["used_bytes"] > disk["bytes_written"]  # headers and keys on disk
    metrics = ServerMetrics("tiny")
    metrics.update(stats)
    samples = {(s.name, s.labels.get("tier")): s.value
               for family in text_string_to_metric_families(metrics.render().decode())
               for s in family.samples}
    assert samples[("pagedkv:kv_store_hits_total", "host")] == 30
    assert samples[("pagedkv:kv_store_misses_total", "host")] == host["misses"]
    assert samples[("pagedkv:kv_store_written_bytes_total", "disk")] == disk["bytes_written"]
    assert samples[("pagedkv:kv_store_blocks", "host")] == host["num_blocks"]
    assert samples[("pagedkv:kv_store_load_seconds_count", "host")] == \
        host["load_seconds"]["count"] > 0
    assert samples[("pagedkv:kv_store_save_seconds_count", "disk")] > 0
