"""What a simulated instance measures: per request (`RequestRecord`), per step when asked
(`StepRecord`), and over the run (`InstanceStats`)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from pagedkv.sched.scheduler import Scheduler


@dataclass
class RequestRecord:
    """What the simulator measured for one trace request (times in virtual seconds)."""

    index: int
    arrival: float
    prompt_tokens: int
    output_tokens: int  # the trace's (the request's max_tokens)
    instance: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finish: float | None = None
    num_tokens: int = 0  # tokens produced so far
    cached_tokens: int = 0
    num_preemptions: int = 0
    status: str = "waiting"  # then running | stop | length | error | rejected
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.last_token is None or self.num_tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.num_tokens - 1)


@dataclass
class StepRecord:
    """One step as the scheduler decided it (kept only with `record_steps`): per scheduled
    request (id, first position, tokens), and the scheduler's preemption counters after it."""

    scheduled: tuple[tuple[str, int, int], ...]
    num_preemptions: int
    num_swaps: int


@dataclass
class InstanceStats:
    """What an instance's run leaves for the results: steps, busy time, KV usage and queue
    lengths over time, inter-token gaps."""

    num_steps: int = 0
    num_jumped_steps: int = 0
    num_jumps: int = 0
    busy_time: float = 0.0
    usage_times: array = field(default_factory=lambda: array("d"))
    usage_values: array = field(default_factory=lambda: array("d"))
    # Beside each usage sample: the scheduler's running requests, and the queued ones
    # (waiting, swapped out, loading their KV).
    running_values: array = field(default_factory=lambda: array("l"))
    waiting_values: array = field(default_factory=lambda: array("l"))
    itl_values: array = field(default_factory=lambda: array("d"))
    itl_weights: array = field(default_factory=lambda: array("d"))

    def record_usage(self, now: float, usage: float, scheduler: Scheduler) -> None:
        """One sample of KV usage and the scheduler's queues at `now`."""
        self.usage_times.append(now)
        self.usage_values.append(usage)
        self.running_values.append(len(scheduler.running))
        self.waiting_values.append(len(scheduler.waiting) + len(scheduler.swapped)
                                   + len(scheduler.loading))
