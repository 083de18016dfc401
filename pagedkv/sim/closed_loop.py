"""A closed-loop load on one simulated engine, as `pagedkv bench serve --max-concurrency C`
makes it: C clients, each sending its next request as soon as it has seen the last token of
its previous one, until `num_prompts` were sent. Unlike a trace's fixed arrivals, the load
answers the schedule: when requests finish in the same step, their successors arrive together
(a wave), and the wave's prefills decide its TTFT.

Delays (seconds): the client sees a token `output` after the engine made it; a request reaches
the engine `admit` after the client sent it, the k-th of those sent at the same moment `k *
spacing` later (the frontend handles them one by one); the engine takes what has arrived
before each step (a request arriving mid-step waits for the step). TTFT and TPOT are the
client's, as the bench measures them.
"""

from __future__ import annotations

import heapq
import math
import statistics
from dataclasses import dataclass, replace

from pagedkv.sim.config import SimConfig
from pagedkv.sim.instance import SimInstance
from pagedkv.sim.latency.base import LatencyModel
from pagedkv.sim.records import RequestRecord
from pagedkv.sim.traces import TraceRequest


@dataclass(frozen=True)
class ClientDelays:
    """The client's and the frontend's delays around the engine (seconds)."""

    admit: float = 0.002
    spacing: float = 0.0005
    output: float = 0.001


@dataclass(frozen=True)
class ClosedLoopResult:
    """What the clients measured: means over the requests (seconds), output tokens per second
    from the first send to the last token seen, and the engine's steps."""

    mean_ttft: float
    mean_tpot: float
    output_throughput: float
    num_steps: int
    records: tuple[RequestRecord, ...]


def simulate_closed_loop(config: SimConfig, latency: LatencyModel, *, concurrency: int,
                         num_prompts: int, input_len: int, output_len: int,
                         delays: ClientDelays = ClientDelays()) -> ClosedLoopResult:
    """Run the load to its end on one `SimInstance` (quiet stretches are stepped, not jumped:
    every finish releases a client). ValueError for a concurrency or prompt count below 1."""
    if concurrency < 1 or num_prompts < 1:
        raise ValueError(f"concurrency and num_prompts must be >= 1, got {concurrency}, "
                         f"{num_prompts}")
    instance = SimInstance(_stepped(config), latency)
    request = TraceRequest(0.0, input_len, output_len)
    pending: list[tuple[float, int, RequestRecord]] = []  # (reaches the engine, index, record)

    def send(at: float, burst: int) -> None:
        for k in range(burst):
            index = len(sent)
            if index == num_prompts:
                return
            record = RequestRecord(index, at, input_len, output_len)
            sent.append(record)
            heapq.heappush(pending, (at + delays.admit + k * delays.spacing, index, record))

    sent: list[RequestRecord] = []
    send(0.0, concurrency)
    seen = 0
    while pending or instance.busy:
        if not instance.busy:
            instance.run_until(pending[0][0])  # idle until the next arrival
        while pending and pending[0][0] <= instance.clock:
            instance.add(heapq.heappop(pending)[2], request)
        if not instance.step():  # nothing can run until an arrival (or ever: ended as errors)
            instance.run_until(pending[0][0] if pending else math.inf)
        done = instance.finished[seen:]
        seen = len(instance.finished)
        if done:
            send(instance.clock + delays.output, len(done))
    return _result(sent, instance, delays)


def _stepped(config: SimConfig) -> SimConfig:
    return config if not config.jump else replace(config, jump=False)


def _result(records: list[RequestRecord], instance: SimInstance,
            delays: ClientDelays) -> ClosedLoopResult:
    ttfts = [r.ttft + delays.output for r in records if r.ttft is not None]
    tpots = [r.tpot for r in records if r.tpot is not None]
    end = max(r.finish or 0.0 for r in records) + delays.output
    tokens = sum(r.num_tokens for r in records)
    return ClosedLoopResult(statistics.fmean(ttfts) if ttfts else math.nan,
                            statistics.fmean(tpots) if tpots else math.nan, tokens / end,
                            instance.stats.num_steps, tuple(records))
