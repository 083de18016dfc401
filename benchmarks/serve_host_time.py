"""The serving time outside the model step (`bench_serve.py`): for each server, how much of the
time the load kept it busy its engine steps filled, the host milliseconds per step around them,
and the CPU time of its frontend process (HTTP, SSE, detokenization, the IPC's receiving end)
and of its engine core process(es) per output token. Linux only (/proc); plain Python.

    busy wall     the load points' benchmark durations (client-side, first request to last
                  answer), the warm-up's included
    step share    the engine's own step times (anchors_steps: pagedkv's `own_seconds`, vLLM's
                  `iteration elapsed time`) over that wall
    host ms/step  (busy wall - the steps' time) / steps: scheduling and output work outside the
                  timed step, the IPC to the frontend, idle waits for new requests

CPU times are read from /proc/PID/stat (user + system) of the server's process (the frontend)
and of every process below it (the engine core; vLLM's and pagedkv's both run it as a child).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _cpu_seconds(fields: list[str]) -> float:
    """user + system seconds from /proc/PID/stat's fields (after the name: utime is the 12th)."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...), from /proc's parent ids."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(int(entry.name))) is not None:
            parents.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def server_cpu(pid: int) -> tuple[float, float]:
    """(frontend, engine core) CPU seconds so far: the process `pid`, and all below it."""
    own = _stat_fields(pid)
    below = [f for child in descendants(pid) if (f := _stat_fields(child)) is not None]
    return (_cpu_seconds(own) if own else 0.0), sum(map(_cpu_seconds, below))


@dataclass
class HostTime:
    """One server's totals over its load points (`add`), then `line()`."""

    busy_s: float = 0.0
    output_tokens: int = 0
    frontend_cpu_s: float = 0.0
    core_cpu_s: float = 0.0
    _cpu_start: tuple[float, float] = field(default=(0.0, 0.0), repr=False)

    def start(self, pid: int) -> None:
        """Before a load point: the server's CPU times now."""
        self._cpu_start = server_cpu(pid)

    def add(self, pid: int, metrics: dict) -> None:
        """After a load point: its benchmark duration, output tokens and the CPU time spent."""
        frontend, core = server_cpu(pid)
        self.frontend_cpu_s += frontend - self._cpu_start[0]
        self.core_cpu_s += core - self._cpu_start[1]
        self.busy_s += metrics["duration_s"]
        self.output_tokens += round(metrics["output_throughput"] * metrics["duration_s"])

    def line(self, step_ms: list[float]) -> str:
        """The summary line, given every step's milliseconds (none: no step figures)."""
        per_token = 1000 / max(self.output_tokens, 1)
        text = (f"CPU per output token: frontend {self.frontend_cpu_s * per_token:.3f} ms, "
                f"engine core {self.core_cpu_s * per_token:.3f} ms")
        if step_ms:
            spent = sum(step_ms) / 1000
            text = (f"steps {100 * spent / self.busy_s:5.1f}% of the busy wall "
                    f"({self.busy_s:.1f} s), host {1000 * (self.busy_s - spent) / len(step_ms):.2f}"
                    f" ms/step; " + text)
        return text
