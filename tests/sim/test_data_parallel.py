"""`pagedkv simulate --data-parallel-size N`: N instances placed by the data-parallel front
end's own `CorePlacer` agree with `--instances N --policy kv-aware` (the router's view of the
same instances) request by request where both see the same state, and run from the command line without
torch."""

from __future__ import annotations

from pagedkv.sim.config import SimConfig
from pagedkv.sim.latency import FunctionLatency
from pagedkv.sim.simulator import simulate
from pagedkv.sim.traces import TraceRequest
from tests.sim.workloads import shared_prefix_trace, simulate_cli_without_torch

LATENCY = FunctionLatency(lambda shape: 2e-3 + 1e-4 * shape.prefill_tokens)
CONFIG = SimConfig(num_blocks=400, block_size=8, max_num_seqs=8)


def _placements(trace: list[TraceRequest], **kw) -> list[int]:
    result = simulate(trace, CONFIG, LATENCY, num_instances=2, **kw)
    assert all(r.status in ("length", "stop") for r in result.records)
    for inst in result.instances:
        inst.kv.pool.check_invariants()
    return [r.instance for r in result.records]


def test_data_parallel_places_as_the_kv_aware_router_does():
    # Requests overlap in decode (each prefills before the next arrives): both views agree
    # on every input of the policy, so every decision is the same.
    trace = shared_prefix_trace(num=40, seed=3, gap=0.02)
    trace = [TraceRequest(arrival=0.03 * i, input_length=t.input_length,
                          output_length=t.output_length, block_ids=t.block_ids,
                          block_tokens=t.block_tokens) for i, t in enumerate(trace)]
    dp = _placements(trace, data_parallel=True)
    router = _placements(trace, policy="kv-aware")
    assert dp == router
    assert 0 < dp.count(0) < len(dp)  # both instances took requests


def test_data_parallel_on_a_bursty_trace_serves_every_request_on_both_cores():
    trace = shared_prefix_trace(num=60, seed=5)
    dp = _placements(trace, data_parallel=True)
    assert 0 < dp.count(0) < len(dp)


def test_the_cli_runs_data_parallel_without_torch_and_refuses_it_with_instances():
    done = simulate_cli_without_torch("--data-parallel-size", "2")
    assert done.returncode == 0, done.stderr
    assert "requests" in done.stdout
    bad = simulate_cli_without_torch("--data-parallel-size", "2", "--instances", "2")
    assert bad.returncode == 2 and "give one" in bad.stderr
    assert "Traceback" not in bad.stderr
