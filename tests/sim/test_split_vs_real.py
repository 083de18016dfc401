"""The simulator's prefill/decode split against a recorded real run: `benchmarks/bench_pd.py
--record` served a slice of the Mooncake conversation trace (lengths x 1/16) through 1 prefill
+ 1 decode `pagedkv serve` behind `pagedkv router --prefill/--decode` (push connector) and
through 2 mixed instances behind the kv-aware router; `data/pd_run/` holds what the client
sent and measured (arrivals, TTFT, TPOT per request), every server's step log and the config.

As bench_pd.py --vs-sim does: a latency model fitted on each server's own steps (the split's
producer for its prefill side, its consumer for its decode side, by ordinary least squares as
its steps are all decode batches; the mixed pair's on theirs),
the same arrivals replayed, over the link speed the run measured. Checked: TTFT and TPOT of
the split against the real run's, and, for a grid of SLOs where the answer can go either
way, which fleet serves more requests within it (the DistServe question) against the real
answer. Seconds of CPU: the fits and two small simulations.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from pagedkv.engine.step_log import read_step_log
from pagedkv.sim.config import SimConfig
from pagedkv.sim.disagg import Split, simulate_split
from pagedkv.sim.latency import FittedLatency
from pagedkv.sim.results import percentile
from pagedkv.sim.simulator import simulate
from pagedkv.sim.slo_winner import flipped, slo_winners
from pagedkv.sim.traces import TraceRequest

RUN = Path(__file__).parent / "data" / "pd_run"


def requests(fleet: str) -> tuple[list[TraceRequest], list[dict]]:
    """The requests as the client sent them (sorted by arrival) and what it measured."""
    rows = sorted(json.loads((RUN / f"{fleet}-requests.json").read_text()),
                  key=lambda r: r["arrival"])
    trace = [TraceRequest(arrival=r["arrival"], input_length=r["input_length"],
                          output_length=r["output_length"], block_ids=tuple(r["block_ids"]),
                          block_tokens=r["block_tokens"], session=r["session"]) for r in rows]
    return trace, rows


def fit(*names: str, absolute: bool = False) -> FittedLatency:
    shapes, times = [], []
    for name in names:
        s, t = read_step_log(RUN / name)
        shapes += s
        times += t
    return FittedLatency.fit(shapes, times, absolute=absolute)


def measured(records) -> list[dict]:
    return [{"ttft": r.ttft, "tpot": r.tpot} for r in records]


def stats(rows: list[dict], name: str) -> tuple[float, float]:
    values = sorted(r[name] for r in rows if r[name] is not None)
    return statistics.fmean(values), percentile(values, 99)


@pytest.fixture(scope="module")
def runs():
    meta = json.loads((RUN / "config.json").read_text())
    config = SimConfig(num_blocks=meta["num_blocks"], block_size=meta["block_size"],
                       max_model_len=meta["max_model_len"], vocab_size=meta["vocab_size"],
                       max_num_batched_tokens=meta["max_num_batched_tokens"],
                       block_bytes=meta["block_bytes"],
                       # recorded before prefill_batching existed: its servers filled the budget
                       prefill_batching=meta.get("prefill_batching", "fill"))
    split_trace, split_real = requests("split")
    split = simulate_split(split_trace, config, fit("split-steps-0.jsonl"),
                           Split(1, 1, meta["link_gbps"]),
                           decode_latency=fit("split-steps-1.jsonl", absolute=True))
    mixed_trace, mixed_real = requests("mixed")
    mixed = simulate(mixed_trace, config, fit("mixed-steps-0.jsonl", "mixed-steps-1.jsonl"),
                     num_instances=2, policy="kv-aware")
    for result in (split, mixed):
        for inst in result.instances:
            inst.scheduler.check_invariants()
            assert inst.kv.num_free_blocks == inst.kv.num_usable_blocks
    return {"split": (split_real, measured(split.records)),
            "mixed": (mixed_real, measured(mixed.records)), "extra": split.extra["split"]}


@pytest.mark.parametrize("name, mean_tol, p99_tol", [("ttft", 0.05, 0.10),
                                                     ("tpot", 0.05, 0.20)])
def test_the_split_times_the_recorded_run(runs, name, mean_tol, p99_tol):
    real, sim = runs["split"]
    assert len(sim) == len(real) and all(r["ttft"] is not None for r in sim)
    (real_mean, real_p99), (sim_mean, sim_p99) = stats(real, name), stats(sim, name)
    assert sim_mean == pytest.approx(real_mean, rel=mean_tol)
    assert sim_p99 == pytest.approx(real_p99, rel=p99_tol)


def test_the_handoff_waits_for_the_busy_producers_steps(runs):
    """Most of the split's TTFT past the prefill queue: the producer's answer leaves only at
    the step ends its server's utility calls wait for (seconds on this run's long steps)."""
    assert runs["extra"]["handoff_seconds_mean"] > 1.0
    assert runs["extra"]["transfers"] == len(runs["split"][0])


def test_the_simulator_picks_the_real_winner_per_slo(runs):
    """Never the other fleet than the real run names; the same answer (a winner by more than
    one request, or a tie) on most of the grid."""
    decisions = slo_winners((runs["split"][0], runs["mixed"][0]),
                            (runs["split"][1], runs["mixed"][1]))
    assert len(decisions) >= 9
    assert not [d for d in decisions if flipped(d)]
    same = sum(d["sim_winner"] == d["real_winner"] for d in decisions)
    assert same >= 0.75 * len(decisions)
    assert {d["real_winner"] for d in decisions} >= {"split", "mixed"}  # the grid spans both
