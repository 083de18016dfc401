"""The serving frontend's delays in the simulator (`pagedkv.sim.frontend`): a request reaches
the engine `admit` seconds after it arrives, and the server sees its tokens `output` seconds
after the engine made them."""

from __future__ import annotations

import math

import pytest

from pagedkv.sim.config import SimConfig
from pagedkv.sim.frontend import FrontendDelays, frontend_of
from pagedkv.sim.latency import FittedLatency, FunctionLatency
from pagedkv.sim.simulator import simulate
from pagedkv.sim.traces import TraceRequest
from tests.sim.workloads import shared_prefix_trace

STEP = 0.010  # every step takes 10 ms
CONFIG = SimConfig(num_blocks=200, block_size=8, max_model_len=512, vocab_size=640)


def _run(trace, delays=None, latency=None):
    result = simulate(trace, CONFIG, latency or FunctionLatency(lambda s: STEP), frontend=delays)
    for inst in result.instances:
        inst.scheduler.check_invariants()
        assert inst.kv.num_free_blocks == inst.kv.num_usable_blocks  # every block came back
    return result.records


def test_delays_shift_an_idle_request_exactly():
    trace = [TraceRequest(arrival=1.0, input_length=20, output_length=4)]
    plain, = _run(trace)
    delayed, = _run(trace, FrontendDelays(admit=0.003, output=0.002, finish=0.005))
    assert plain.first_scheduled == 1.0 and delayed.first_scheduled == pytest.approx(1.003)
    assert plain.ttft == pytest.approx(STEP)  # one step: the prompt and the first token
    assert delayed.ttft == pytest.approx(0.003 + STEP + 0.002)
    assert delayed.e2e == pytest.approx(0.003 + 4 * STEP + 0.005)
    assert plain.tpot == pytest.approx(STEP)
    # the server's TPOT: (e2e - ttft) / (tokens - 1), the hand-overs' difference included
    assert delayed.tpot == pytest.approx((delayed.e2e - delayed.ttft) / 3)
    assert delayed.tpot == pytest.approx(STEP + 0.003 / 3)
    assert delayed.arrival == plain.arrival == 1.0  # latencies count from the arrival


def test_admit_delay_shifts_every_decision_in_time():
    # A constant admission delay is the trace arriving that much later: the same steps in the
    # same order, each request's first step, first token and finish `admit` later.
    trace = shared_prefix_trace(num=12)
    plain = _run(trace)
    delayed = _run(trace, FrontendDelays(admit=0.0035))
    for p, d in zip(plain, delayed, strict=True):
        assert d.arrival == p.arrival and d.num_tokens == p.num_tokens
        assert d.first_scheduled == pytest.approx(p.first_scheduled + 0.0035)
        assert d.ttft == pytest.approx(p.ttft + 0.0035)
        assert d.e2e == pytest.approx(p.e2e + 0.0035)


def test_zero_delays_change_nothing():
    trace = shared_prefix_trace(num=12)
    plain = _run(trace)
    zero = _run(trace, FrontendDelays())
    assert [(r.first_scheduled, r.first_token, r.finish, r.num_tokens) for r in plain] == \
        [(r.first_scheduled, r.first_token, r.finish, r.num_tokens) for r in zero]


def test_delays_come_with_a_fitted_model(tmp_path):
    delays = FrontendDelays(admit=0.004, output=0.001, finish=0.002)
    fitted = FittedLatency({"intercept": STEP}).with_frontend(delays)
    path = tmp_path / "latency.json"
    fitted.save(path)
    loaded = FittedLatency.load(path)
    assert frontend_of(loaded) == delays and frontend_of(FunctionLatency(lambda s: STEP)) == FrontendDelays()
    trace = [TraceRequest(arrival=0.0, input_length=20, output_length=3)]
    carried, = _run(trace, latency=loaded)  # no `frontend`: the model's own
    assert carried.ttft == pytest.approx(0.004 + STEP + 0.001)
    given, = _run(trace, FrontendDelays(), latency=loaded)  # given: it wins
    assert given.ttft == pytest.approx(STEP)


def test_fit_takes_the_medians_of_a_request_log():
    rows = [{"submitted": 0.001, "ttft": 0.050, "engine_first_token": 0.048, "e2e": 0.5,
             "engine_last_token": 0.49},
            {"submitted": 0.003, "ttft": 0.080, "engine_first_token": 0.077, "e2e": 0.6,
             "engine_last_token": 0.596},
            {"submitted": 0.002, "ttft": 0.020, "engine_first_token": 0.019, "e2e": 0.7,
             "engine_last_token": 0.698},
            {"ttft": 0.5, "e2e": 0.9}]  # a row from before the timeline fields: skipped
    delays = FrontendDelays.fit(rows)
    assert delays.admit == pytest.approx(0.002) and delays.output == pytest.approx(0.002)
    assert delays.finish == pytest.approx(0.004)
    with pytest.raises(ValueError, match="no frontend timeline"):
        FrontendDelays.fit([{"ttft": 0.5}])


def test_a_burst_within_the_wake_joins_the_idle_engines_first_step():
    # An idle engine loop starts its first step `wake` after a request reaches it: requests
    # of the same burst that reach it meanwhile are in that step, the rest wait for the next.
    trace = [TraceRequest(arrival=a, input_length=20, output_length=3)
             for a in (1.0, 1.0004, 1.0009, 1.0012)]
    asleep = _run(trace, FrontendDelays(wake=0.001))
    assert [r.first_scheduled for r in asleep] == pytest.approx([1.001] * 3 + [1.001 + STEP])
    assert [r.ttft for r in asleep[:3]] == pytest.approx([0.001 + STEP, 0.0006 + STEP,
                                                         0.0001 + STEP])
    awake = _run(trace)  # no wake: the first request's step starts at once, alone
    assert [r.first_scheduled for r in awake] == pytest.approx([1.0] + [1.0 + STEP] * 3)


def test_the_wake_delays_only_an_idle_engine():
    # The second request reaches the engine while it steps: it joins the next step at the
    # step boundary, no wake; the third comes after everything finished: woken again.
    trace = [TraceRequest(arrival=0.0, input_length=20, output_length=3),
             TraceRequest(arrival=0.015, input_length=20, output_length=2),
             TraceRequest(arrival=1.0, input_length=20, output_length=2)]
    first, second, third = _run(trace, FrontendDelays(wake=0.002))
    assert first.first_scheduled == pytest.approx(0.002)
    assert second.first_scheduled == pytest.approx(0.002 + 2 * STEP)
    assert third.first_scheduled == pytest.approx(1.002)
    assert third.ttft == pytest.approx(0.002 + STEP)


def test_fit_takes_the_wake_from_requests_that_found_the_engine_idle():
    def row(arrival, submitted, first_scheduled, last):
        return {"arrival": arrival, "submitted": submitted, "first_scheduled": first_scheduled,
                "engine_last_token": last, "ttft": last / 2, "engine_first_token": last / 2,
                "e2e": last}

    rows = [row(100.0, 0.001, 0.0018, 0.5),  # idle engine: woke 0.8 ms after submission
            row(100.1, 0.001, 0.05, 0.6),  # the first still runs: queued, not a wake
            row(102.0, 0.002, 0.0032, 0.4),  # idle again (both ended by 100.7): 1.2 ms
            row(103.0, 0.002, 0.0030, 0.4)]  # idle again: 1.0 ms
    assert FrontendDelays.fit(rows).wake == pytest.approx(0.001)
    # a log without the arrivals cannot tell: no wake
    assert FrontendDelays.fit([{k: v for k, v in r.items() if k != "arrival"}
                               for r in rows]).wake == 0.0
    busy = [row(100.0, 0.001, 0.0018, 0.5), row(100.2, 0.001, 0.3, 0.9)]
    assert FrontendDelays.fit(busy).wake == pytest.approx(0.0008)


def test_delays_round_trip_and_an_older_file_has_no_wake():
    delays = FrontendDelays(admit=0.001, output=0.002, finish=0.003, wake=0.0007)
    assert FrontendDelays.from_dict(delays.to_dict()) == delays
    assert FrontendDelays.from_dict({"admit": 0.001, "output": 0.002, "finish": 0.003}).wake == 0
    assert not FrontendDelays(wake=0.001).is_zero


@pytest.mark.parametrize("bad", [-0.001, math.nan, math.inf, True, "1"])
def test_bad_delays_are_refused(bad):
    with pytest.raises(ValueError, match=f"admit .*got {bad!r}"):
        FrontendDelays(admit=bad)


def test_bad_delays_in_a_model_file_are_refused(tmp_path):
    with pytest.raises(ValueError, match="frontend delays"):
        FrontendDelays.from_dict({"admit": 0.0, "lag": 1.0})
    path = tmp_path / "latency.json"
    path.write_text('{"kind": "fitted", "coefficients": {}, "frontend": {"output": -1}}')
    with pytest.raises(ValueError, match="latency.json.*output"):
        FittedLatency.load(path)
