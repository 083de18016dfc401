"""Results: SLO parsing, percentiles, summaries that count what happened, sweeps and the
capacity search, routing over several instances, the CLI, and no torch on the way."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from pagedkv.sim.config import SimConfig
from pagedkv.sim.latency import FunctionLatency, StepShape
from pagedkv.sim.results import SLO, format_table, percentile, summarize
from pagedkv.sim.search import capacity_search, parse_sweep, run_with, sweep
from pagedkv.sim.simulator import simulate
from tests.sim.workloads import shared_prefix_trace, simulate_cli_without_torch

MOONCAKE = "tests/sim/data/mooncake_conversation_head40.jsonl"


def long_trace(num: int = 20):
    return [dataclasses.replace(r, output_length=r.output_length * 4)
            for r in shared_prefix_trace(num=num, block_tokens=8)]


def step_time(shape: StepShape) -> float:
    return 2e-3 + 1e-4 * shape.prefill_tokens + 2e-4 * shape.decode_seqs


def test_slo_parse_and_percentiles():
    slo = SLO.parse("ttft=2,tpot=50ms")
    assert slo == SLO(ttft=2.0, tpot=0.05)
    assert slo.met(1.0, 0.04, 9.0) and not slo.met(3.0, 0.01, 4.0) and slo.met(1.0, None, 1.0)
    for bad in ("ttft", "foo=1", "ttft=-1", "ttft=abc"):
        with pytest.raises(ValueError):
            SLO.parse(bad)
    assert percentile([1, 2, 3, 4], 50) == 2 and percentile([1, 2, 3, 4], 99) == 4
    assert percentile([1.0, 5.0], 50, weights=[3, 1]) == 1.0


def test_summary_counts_match_the_records():
    trace = long_trace()
    config = SimConfig(num_blocks=40, block_size=8, max_num_seqs=6, max_num_batched_tokens=32,
                       max_model_len=512, vocab_size=500)
    result = simulate(trace, config, FunctionLatency(step_time))
    s = summarize(result, SLO(ttft=0.05))
    assert s["requests"] == s["finished"] == 20
    assert s["latency"]["ttft"]["count"] == 20
    out_tokens = sum(t.output_length for t in trace)
    assert s["throughput"]["output_tokens_per_s"] * s["duration_s"] == pytest.approx(out_tokens)
    # ITL samples: every token but each request's first.
    assert s["latency"]["itl"]["count"] == out_tokens - 20
    ttfts = sorted(r.ttft for r in result.records)
    assert s["latency"]["ttft"]["p50"] == ttfts[9]
    good = sum(1 for r in result.records if r.ttft <= 0.05)
    assert s["goodput"]["fraction"] == good / 20
    sched = result.instances[0].scheduler
    assert s["preemptions"]["total"] == sched.num_preemptions > 0
    assert s["prefix_cache"]["device"]["hit_tokens"] == sched.prefix_cache_hits > 0
    assert s["evicted_blocks"] == sched.kv_cache_manager.pool.num_evicted_blocks > 0
    assert 0 < s["kv_usage"]["mean"] <= s["kv_usage"]["peak"] <= 1
    assert "ttft" in format_table(s) and "goodput" in format_table(s)


def test_sweep_and_capacity_search():
    trace = long_trace()
    config = SimConfig(num_blocks=40, block_size=8, max_num_seqs=8, max_num_batched_tokens=64,
                       max_model_len=512, vocab_size=500)
    latency = FunctionLatency(step_time)
    assert parse_sweep("num_blocks=40,400") == ("num_blocks", [40, 400])
    assert parse_sweep("eviction_policy=lru,lfu") == ("eviction_policy", ["lru", "lfu"])
    with pytest.raises(ValueError, match="SETTING"):
        parse_sweep("warp=1")
    rows = sweep(trace, config, latency, "num_blocks", [40, 400])
    assert rows[0]["preemptions"]["total"] > rows[1]["preemptions"]["total"] == 0
    slo = SLO(ttft=0.6)
    found = capacity_search(trace, config, latency, slo, target=0.9, low=10, high=400)
    value = found["value"]
    assert value is not None and found["summary"]["goodput"]["fraction"] >= 0.9
    below = [v for v, s in found["tried"].items() if v < value]
    assert below and all(found["tried"][v]["goodput"]["fraction"] < 0.9 for v in below)


def test_a_preemption_mode_sweep_swaps_in_its_swap_row():
    # The swap space is the config's in either mode and used only in swap mode (as the
    # engine's): a sweep from recompute to swap once ran its swap row without host blocks,
    # so it recomputed.
    trace = long_trace()
    config = SimConfig(num_blocks=40, block_size=8, max_num_seqs=6, max_num_batched_tokens=32,
                       max_model_len=512, vocab_size=500, num_host_blocks=200)
    latency = FunctionLatency(step_time)
    counts = {}
    for mode in ("recompute", "swap"):
        result = run_with(trace, config, latency, "preemption_mode", mode)
        sched = result.instances[0].scheduler
        sched.check_invariants()
        assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_usable_blocks
        assert all(r.num_tokens == t.output_length for r, t in zip(result.records, trace,
                                                                   strict=True))
        counts[mode] = (sched.num_preemptions, sched.num_swaps)
    assert counts["recompute"][0] > 0 and counts["recompute"][1] == 0
    assert counts["swap"][1] > 0
    rows = sweep(trace, config, latency, "preemption_mode", ["recompute", "swap"])
    assert [r["preemptions"]["swap"] for r in rows] == [0, counts["swap"][1]]


@pytest.mark.parametrize(("change", "named"), [
    ({"preemption_mode": "bar"}, "preemption_mode"), ({"scheduling_policy": "zzz"}, "policy"),
    ({"max_num_seqs": -1}, "max_num_seqs"), ({"max_num_batched_tokens": 0}, "batched"),
    ({"max_model_len": 0}, "max_model_len"), ({"num_blocks": 1}, "num_blocks"),
    ({"block_size": 0}, "block_size"), ({"num_host_blocks": -1}, "num_host_blocks"),
    ({"eviction_policy": "mru"}, "eviction_policy"), ({"vocab_size": 3}, "vocab_size"),
    ({"store_tiers": "x"}, "store_tiers")])
def test_bad_settings_are_refused_when_made(change, named):
    # a sweep makes its configs with dataclasses.replace: a bad value is a ValueError naming
    # it there, not a silent fallback (preemption_mode=bar ran as recompute) or a crash
    config = SimConfig(num_blocks=40)
    with pytest.raises(ValueError, match=named):
        dataclasses.replace(config, **change)
    setting, value = next(iter(change.items()))
    if setting in ("store_tiers", "vocab_size", "num_host_blocks"):
        return
    with pytest.raises(ValueError, match=named):
        sweep(long_trace(4), config, FunctionLatency(step_time), setting, [value])


def test_only_flag_like_settings_are_sweepable():
    for internal in ("store_tiers", "block_bytes", "jump"):
        with pytest.raises(ValueError, match="SETTING"):
            parse_sweep(f"{internal}=1")
    assert parse_sweep("preemption_mode=recompute,swap") == ("preemption_mode",
                                                             ["recompute", "swap"])


def test_kv_aware_routing_keeps_prefixes_together():
    trace = shared_prefix_trace(num=60, block_tokens=8, gap=0.01)
    config = SimConfig(num_blocks=120, block_size=8, max_num_seqs=8, max_num_batched_tokens=64,
                       max_model_len=512, vocab_size=500)
    hits = {}
    for policy in ("round-robin", "kv-aware"):
        result = simulate(trace, config, FunctionLatency(step_time), num_instances=3,
                          policy=policy)
        assert {r.instance for r in result.records} == {0, 1, 2}
        hits[policy] = summarize(result)["prefix_cache"]["device"]["hit_tokens"]
        for inst in result.instances:
            inst.scheduler.check_invariants()
    assert hits["kv-aware"] > hits["round-robin"]


def test_cli_simulate_and_no_torch(tmp_path):
    out = tmp_path / "s.json"
    png = tmp_path / "s.png"
    proc = simulate_cli_without_torch("--slo", "ttft=1,tpot=0.2", "--json", str(out),
                                      "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(out.read_text())
    assert summary["requests"] == 40 and summary["finished"] == 40
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "goodput" in proc.stdout
    for flags, says in ((["--slo", "ttft"], "bad SLO part"),
                        (["--limit", "-5"], "limit must be"),
                        (["--sweep", "preemption_mode=bar"], "preemption_mode must be"),
                        (["--sweep", "store_tiers=x"], "bad --sweep"),
                        (["--max-model-len", "0"], "max_model_len must be"),
                        (["--sweep", "num_blocks=100,200", "--search", "instances", "--slo",
                          "ttft=1"], "give one")):
        bad = subprocess.run([sys.executable, "-m", "pagedkv.cli", "simulate", MOONCAKE,
                              *flags], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and says in bad.stderr, (flags, bad.stderr)
        assert "Traceback" not in bad.stderr
