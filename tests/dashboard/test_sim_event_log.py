"""`pagedkv simulate --event-log PATH` writes the dashboard's recorded-log format: replayed
through the page's state model it ends in the simulated engine's own final block state, with
the simulator's counts in its stats (issue 23; pagedkv/sim/event_log.py)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from pagedkv.kv.observer import pool_snapshot
from pagedkv.server.dashboard.state import PageState
from pagedkv.sim.config import SimConfig
from pagedkv.sim.event_log import SimEventLog
from pagedkv.sim.latency import FunctionLatency, StepShape
from pagedkv.sim.simulator import simulate
from tests.sim.workloads import shared_prefix_trace, simulate_cli_without_torch

MOONCAKE = "tests/sim/data/mooncake_conversation_head40.jsonl"


def _step_time(shape: StepShape) -> float:
    return 2e-3 + 1e-4 * shape.prefill_tokens + 2e-4 * shape.decode_seqs


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_the_log_replays_to_the_simulated_engines_state(tmp_path, policy):
    trace = [dataclasses.replace(r, output_length=r.output_length * 3)
             for r in shared_prefix_trace(num=60, block_tokens=8, gap=0.01)]
    config = SimConfig(num_blocks=40, block_size=8, eviction_policy=policy)
    log = SimEventLog(period_s=0.05, start_time=1000.0)
    result = simulate(trace, config, FunctionLatency(_step_time), on_instance=log.attach)
    path = tmp_path / "sim-log.json"
    log.write(path)
    data = json.loads(path.read_text())
    assert set(data) >= {"snapshot", "updates"} and data["truncated"] is False
    updates = data["updates"]
    assert len(updates) >= 10
    times = [u["t"] for u in updates]
    assert times == sorted(times) and times[0] >= 1000.0
    assert all(b - a >= 0.05 - 1e-9 for a, b in zip(times[:-2], times[1:-1], strict=True))
    assert max(u["stats"]["num_running"] for u in updates) > 0
    # Replayed as the page does: the final state is the simulated pool's own, ranks included.
    state = PageState(data["snapshot"]["pools"])
    for update in updates:
        state.apply(update["ops"], update["t"])
    kv = result.instances[0].kv
    want = pool_snapshot(kv.pool, kv.pins.pin_counts())
    got = state.pools[0].snapshot()
    assert got["refs"] == want["refs"] and got["hashes"] == want["hashes"]
    assert got["free_order"] == want["free_order"] and got["free_order"]
    assert kv.pool.num_evicted_blocks > 0  # the small cache really evicted
    kv.check_invariants()
    # The stats are the simulator's own counts.
    last = updates[-1]["stats"]
    records = result.records
    assert last["num_running"] == 0 and last["num_waiting"] == 0
    assert last["generation_tokens"] == sum(r.num_tokens for r in records)
    assert last["ttft_count"] == sum(1 for r in records if r.first_token is not None)
    assert last["num_evictions"] == kv.eviction_log.num_evictions
    assert last["prefix_cache_hits"] > 0


def test_a_log_past_its_bound_says_truncated(tmp_path):
    log = SimEventLog(period_s=0.001, max_updates=5)
    simulate(shared_prefix_trace(num=20), SimConfig(num_blocks=64, block_size=8),
             FunctionLatency(_step_time), on_instance=log.attach)
    log.write(tmp_path / "log.json")
    data = json.loads((tmp_path / "log.json").read_text())
    assert len(data["updates"]) == 5 and data["truncated"] is True
    with pytest.raises(ValueError, match="period_s"):
        SimEventLog(period_s=0)
    with pytest.raises(ValueError, match="max_updates"):
        SimEventLog(max_updates=0)


def test_cli_event_log_without_torch(tmp_path):
    out = tmp_path / "sim-log.json"
    proc = simulate_cli_without_torch("--event-log", str(out))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert len(data["snapshot"]["pools"][0]["refs"]) == 400 and len(data["updates"]) > 1
    assert data["updates"][-1]["stats"]["num_running"] == 0
    assert "event log (instance 0" in proc.stderr
    bad = subprocess.run([sys.executable, "-m", "pagedkv.cli", "simulate", MOONCAKE,
                          "--event-log", str(out), "--sweep", "max_num_seqs=1,2"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--event-log records one run" in bad.stderr
