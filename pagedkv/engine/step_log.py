"""A step log: one JSON line per engine step that computed something, the shape the simulator's
latency model sees (`StepShape`) and how long the real engine took. Written by
`EngineArgs.step_log` (`pagedkv serve --step-log PATH`); read back by `pagedkv profile
--fit-from PATH` to fit a latency model on a real run's own steps instead of a grid.

Each line: the `StepShape` fields, `seconds` (from this step's start to the next step's start
when the engine went straight on: scheduling, the model, sampling, output processing and
whatever the loop does between steps, which is the time the simulator's clock must advance;
else, before an idle wait, the step's own time), `cpu_seconds` (the engine thread's CPU time
over the same span: with one compute thread, the step's work without the time other processes
took from it on a shared machine), `own_seconds` (the step alone, from its start to its outputs:
`seconds - own_seconds` is the host gap before the next step, where the serving loop delivers
outputs and takes new requests) and `chained` (which of the two it is). Torch-free.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, fields
from pathlib import Path

from pagedkv.engine.step_shape import StepShape
from pagedkv.jsonl import JsonLinesWriter
from pagedkv.sched.output import SchedulerOutput

_SHAPE_FIELDS = tuple(f.name for f in fields(StepShape))
_LATER = ("prefill_past",)  # shape fields a log written before they existed lacks


class StepLog:
    """Appends step lines to `path`. Call `step_started()` at the start of every engine step
    and `step_ended(out, busy)` at its end; mutates only its own pending step and the file."""

    def __init__(self, path: str | Path) -> None:
        self._out = JsonLinesWriter(path)
        # A busy step waiting for the next one to start: (shape, wall start, CPU start, own
        # seconds).
        self._pending: tuple[StepShape, float, float, float] | None = None
        self._start = self._cpu_start = 0.0

    def step_started(self) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        if self._pending is not None:
            shape, start, cpu_start, own = self._pending
            self._write(shape, now - start, cpu - cpu_start, own, chained=True)
            self._pending = None
        self._start, self._cpu_start = now, cpu

    def step_ended(self, out: SchedulerOutput, busy: bool) -> None:
        """`busy`: the engine has unfinished requests, so the next step follows at once and
        closes this one; otherwise this step's own time is written now."""
        if not out.scheduled:
            return
        shape = StepShape.of(out)
        own = time.perf_counter() - self._start
        if busy:
            self._pending = (shape, self._start, self._cpu_start, own)
        else:
            self._write(shape, own, time.thread_time() - self._cpu_start, own, chained=False)

    def _write(self, shape: StepShape, seconds: float, cpu_seconds: float, own_seconds: float,
               *, chained: bool) -> None:
        self._out.write({**asdict(shape), "seconds": seconds, "cpu_seconds": cpu_seconds,
                         "own_seconds": own_seconds, "chained": chained})

    def close(self) -> None:
        self._out.close()


# clock name -> the step log's field: the time to the next step, its CPU time, the step alone
STEP_CLOCKS = {"wall": "seconds", "cpu": "cpu_seconds", "own": "own_seconds"}


def read_step_log(path: str | Path, clock: str = "wall") -> tuple[list[StepShape], list[float]]:
    """(shapes, durations) of a step log by `clock` (`STEP_CLOCKS`: "wall" the time to the next
    step, "cpu" its CPU time, "own" the step alone). ValueError naming the file and line when a
    line is not a step."""
    if clock not in STEP_CLOCKS:
        raise ValueError(f"clock must be one of {list(STEP_CLOCKS)}, got {clock!r}")
    key = STEP_CLOCKS[clock]
    shapes, times = [], []
    text = Path(path).read_text(encoding="utf-8")
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            shape = StepShape(**{k: row[k] for k in _SHAPE_FIELDS if k not in _LATER},
                              **{k: row[k] for k in _LATER if k in row})
            seconds = float(row[key])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"step log {str(path)!r} line {number} is not a step: {exc}") from None
        shapes.append(shape)
        times.append(seconds)
    if not shapes:
        raise ValueError(f"step log {str(path)!r} has no steps")
    return shapes, times
