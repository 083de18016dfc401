"""`pagedkv bench serve`: its datasets and metric definitions, and a small run of each dataset
against the test server."""

from __future__ import annotations

import json

import pytest

from pagedkv.bench.datasets import sample_requests
from pagedkv.bench.metrics import RequestResult, compute_metrics, format_table, percentile
from pagedkv.cli import main


def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) == 0.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)
    assert percentile([10.0, 0.0], 25) == pytest.approx(2.5)


def test_metric_definitions():
    results = [
        RequestResult(success=True, prompt_len=10, output_tokens=5, ttft=0.1, latency=0.5,
                      itl=[0.1, 0.1, 0.1, 0.1]),
        RequestResult(success=True, prompt_len=20, output_tokens=1, ttft=0.2, latency=0.2),
        RequestResult(success=False, prompt_len=30, error="HTTP 503"),
    ]
    m = compute_metrics(results, duration=2.0, prefix_cache=(30.0, 120.0))
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 6)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(18.0)
    # TPOT excludes the first token and requests with a single output token.
    assert m["tpot_ms"]["mean"] == pytest.approx((0.5 - 0.1) / 4 * 1000)
    assert m["ttft_ms"]["median"] == pytest.approx(150.0)
    assert m["itl_ms"]["mean"] == pytest.approx(100.0)
    assert m["e2el_ms"]["p99"] == pytest.approx((0.2 + 0.99 * 0.3) * 1000)
    assert m["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert m["errors"] == ["HTTP 503"]
    assert "Prefix cache hit rate:" in format_table(m) and "25.00%" in format_table(m)


def test_datasets_are_seeded_and_shaped():
    random_a = sample_requests("random", num_prompts=5, input_len=12, output_len=3,
                               vocab_size=100, seed=1)
    assert random_a == sample_requests("random", num_prompts=5, input_len=12, output_len=3,
                                       vocab_size=100, seed=1)
    assert [r.prompt_len for r in random_a] == [12] * 5
    assert all(10 <= t < 100 for r in random_a for t in r.prompt_token_ids)
    shared = sample_requests("shared-prefix", num_prompts=4, input_len=6, output_len=2,
                             vocab_size=100, prefix_len=20, seed=2)
    assert len({tuple(r.prompt_token_ids[:20]) for r in shared}) == 1
    assert len({tuple(r.prompt_token_ids[20:]) for r in shared}) == 4
    assert [r.prompt_len for r in shared] == [26] * 4
    with pytest.raises(ValueError, match="dataset"):
        sample_requests("sharegpt", num_prompts=1, input_len=1, output_len=1, vocab_size=100)


def run_bench(capsys, url: str, *flags: str) -> dict:
    code = main(["bench", "serve", "--url", url, "--json", "--no-progress", *flags])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def test_bench_serve_random_and_shared_prefix(server, capsys):
    random_run = run_bench(capsys, server.url, "--dataset", "random", "--num-prompts", "8",
                           "--input-len", "16", "--output-len", "4", "--request-rate", "inf")
    assert (random_run["completed"], random_run["failed"]) == (8, 0)
    assert random_run["total_output_tokens"] == 32 and random_run["total_input_tokens"] == 128
    assert random_run["ttft_ms"]["mean"] > 0 and random_run["tpot_ms"]["mean"] > 0
    # One at a time, so every request after the first finds the 32-token prefix cached.
    shared = run_bench(capsys, server.url, "--dataset", "shared-prefix", "--num-prompts", "6",
                       "--prefix-len", "32", "--input-len", "8", "--output-len", "3",
                       "--max-concurrency", "1", "--request-rate", "inf")
    assert (shared["completed"], shared["total_output_tokens"]) == (6, 18)
    assert shared["prefix_cache_queries"] == 6 * 40
    assert shared["prefix_cache_hits"] >= 5 * 32
    assert shared["prefix_cache_hit_rate"] >= 5 * 32 / (6 * 40)
    assert shared["client_cached_tokens"] == shared["prefix_cache_hits"]
