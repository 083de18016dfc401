"""CpuThreadGovernor: torch's intra-op thread count on a CPU engine, from the cores left free.

Each matrix product and fused kernel splits its work over torch's OpenMP threads and waits for
the slowest. On a machine shared with other busy processes, a thread that loses its core holds
every step up (and the others spin meanwhile): with two cores and another process busy on them,
two threads ran at half the speed of one. So the governor measures, about once a second, how
much CPU time the other processes took on this process's allowed CPUs (/proc/stat per CPU,
minus this process's own time from /proc/self/stat) and runs on the cores they leave: all of
them on a quiet machine, fewer as others take cores, never fewer than one.

The engine's own frontend is not "another process": an engine core in its own process counts
its frontend's CPU (`count_as_own(os.getppid())`: HTTP, SSE, detokenization) as its own. That
work comes in bursts (64 streams' first tokens at once) and takes a fraction of a core; read as
a taken core, it halved the threads for a second at a time exactly when a burst of prompts
arrived (a 2,048-token prefill step 83 -> 165 ms), where keeping every thread loses little.

Where /proc is unreadable (not Linux) it leaves the thread count alone. The thread count is
torch's, hence the process's: engines in one process share it (each governor sets the same
count from the same readings). `OMP_NUM_THREADS`, when set, is the most it uses, as torch's
own default honours it (e.g. several engines or test workers sharing the cores).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

import torch

# How often the reading is refreshed (seconds) and the margin (in cores) before a core that
# others use only part of the time counts as taken: half a core, the break-even (with its core
# shared with a process taking a fraction f of it, a thread's share of the work takes 1 / (1 - f)
# as long, so two threads beat one while f < 1/2). At 0.35, a served burst of 64 streams (the
# load generator on the same machine) halved the threads: 2,048-token steps 90 -> 180 ms.
INTERVAL_S = 1.0
SLACK_CORES = 0.5
# A reading whose window spans an idle gap this long (no steps, so no adjust calls) tells what
# other processes did while this engine was idle, not what they do now: e.g. a benchmark's
# other engine, done before this one starts. Such a window is dropped; every core is used again
# and a first short window (FIRST_INTERVAL_S) measures the machine as it is. The gap runs from
# the end of the last step (`step_done`) where the caller reports it: one long step (a big
# prefill on a busy machine) is work, not idleness, and keeps the reading it earned.
STALE_S = 3.0
FIRST_INTERVAL_S = 0.25


def allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def omp_thread_limit() -> int | None:
    """`OMP_NUM_THREADS` as a positive int, or None when unset or not one."""
    try:
        limit = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return None
    return limit if limit >= 1 else None


def busy_ticks(cpus: list[int]) -> int | None:
    """Busy clock ticks (all but idle and iowait) summed over `cpus`, or None without /proc."""
    wanted = {f"cpu{c}" for c in cpus}
    total = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                fields = line.split()
                if fields and fields[0] in wanted:
                    ticks = [int(x) for x in fields[1:9]]
                    total += sum(ticks) - ticks[3] - ticks[4]
    except (OSError, ValueError):
        return None
    return total


# Processes whose CPU time counts as this process's own (the engine core's frontend).
_PARTNER_PIDS: set[int] = set()


def count_as_own(pid: int) -> None:
    """Count process `pid`'s CPU time as this process's own in every governor's readings (an
    engine core's frontend: see the module docstring). Mutates a process-wide set."""
    _PARTNER_PIDS.add(pid)


def _process_ticks(stat_path: str) -> int | None:
    """User + system clock ticks (all threads) from a /proc/PID/stat file, or None."""
    try:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None


def _own_ticks() -> int | None:
    """This process's user + system clock ticks (all its threads) and those of the processes
    `count_as_own` named (while they exist), or None without /proc."""
    own = _process_ticks("/proc/self/stat")
    if own is None:
        return None
    return own + sum(_process_ticks(f"/proc/{pid}/stat") or 0 for pid in _PARTNER_PIDS)


def read_proc_ticks(cpus: list[int]) -> tuple[int | None, int | None]:
    """(busy ticks of `cpus`, this process's own ticks) from /proc; None where unreadable."""
    return busy_ticks(cpus), _own_ticks()


def threads_for(num_cpus: int, others_cores: float, max_threads: int) -> int:
    """The thread count for `num_cpus` allowed CPUs of which other processes took
    `others_cores` cores' worth: the cores left (a core others use less than SLACK_CORES of
    counts as free), at most `max_threads`, and never fewer than one, whatever the reading
    (others holding every core or more, a counter that went backwards, NaN)."""
    if not math.isfinite(others_cores):
        others_cores = float(num_cpus) if others_cores > 0 else 0.0
    free = num_cpus - max(0.0, others_cores)
    return max(1, min(max_threads, math.floor(free + SLACK_CORES)))


class CpuThreadGovernor:
    """Sets torch's thread count to the allowed cores that other processes leave free.

    `max_threads`: the most threads to use (default: every CPU this process may run on, at
    most `OMP_NUM_THREADS` when that is set).
    `adjust()` is cheap (a clock read) except about once per INTERVAL_S, when it reads /proc;
    call it between steps. Mutates torch's thread count only when the choice changes.
    `read_ticks(cpus) -> (busy, own)` and `clock` are the seams tests drive (default: /proc
    and `time.monotonic`)."""

    def __init__(self, max_threads: int | None = None, *,
                 read_ticks: Callable[[list[int]], tuple[int | None, int | None]] | None = None,
                 clock: Callable[[], float] | None = None,
                 cpus: list[int] | None = None, ticks_per_s: int | None = None) -> None:
        self.cpus = cpus if cpus is not None else allowed_cpus()
        max_threads = max_threads or omp_thread_limit() or len(self.cpus)
        self.max_threads = max(1, min(max_threads, len(self.cpus)))
        if ticks_per_s is None:
            ticks_per_s = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.ticks_per_s = ticks_per_s
        self._read_ticks = read_ticks or read_proc_ticks
        self._clock = clock or time.monotonic
        self._last: tuple[float, int, int] | None = None
        self._last_step_end: float | None = None
        self._interval = FIRST_INTERVAL_S
        self.others_cores = 0.0  # the last reading: cores' worth of CPU the others took
        self._set(self.max_threads)

    def _set(self, threads: int) -> None:
        threads = max(1, int(threads))  # torch.set_num_threads(0) raises inside the step
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self.threads = threads

    def adjust(self) -> int:
        """Re-read the machine when the interval has passed and set the thread count; returns
        the thread count in use."""
        now = self._clock()
        if self._last is not None and now - self._last[0] < self._interval:
            return self.threads
        busy, own = self._read_ticks(self.cpus)
        if busy is None or own is None:
            return self.threads
        if self._last is None or now - max(self._last[0], self._last_step_end or 0.0) > STALE_S:
            self._set(self.max_threads)  # first call, or after an idle gap: see STALE_S
            self._interval = FIRST_INTERVAL_S
        else:
            elapsed_ticks = max((now - self._last[0]) * self.ticks_per_s, 1e-9)
            others = (busy - self._last[1]) - (own - self._last[2])
            self.others_cores = max(0.0, others / elapsed_ticks)
            self._set(threads_for(len(self.cpus), self.others_cores, self.max_threads))
            self._interval = INTERVAL_S
        self._last = (now, busy, own)
        return self.threads

    def step_done(self) -> None:
        """The step that called `adjust()` ended (a clock read): idle gaps count from here."""
        self._last_step_end = self._clock()
