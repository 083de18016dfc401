"""CpuThreadGovernor: torch's intra-op thread count on a CPU engine, from the cores left free.

Each matrix product and fused kernel splits its work over torch's OpenMP threads and waits for
the slowest. On a machine shared with other busy processes, a thread that loses its core holds
every step up (and the others spin meanwhile): with two cores and another process busy on them,
two threads ran at half the speed of one. So the governor measures, about once a second, how
much CPU time the other processes took on this process's allowed CPUs (/proc/stat per CPU,
minus this process's own time from /proc/self/stat) and runs on the cores they leave: all of
them on a quiet machine, fewer as others take cores, never fewer than one.

Where /proc is unreadable (not Linux) it leaves the thread count alone. The thread count is
torch's, hence the process's: engines in one process share it (each governor sets the same
count from the same readings).
"""

from __future__ import annotations

import os
import time

import torch

# How often the reading is refreshed (seconds) and the margin (in cores) before a core that
# others use only part of the time counts as taken.
INTERVAL_S = 1.0
SLACK_CORES = 0.35
# A reading whose window spans an idle gap this long (no steps, so no adjust calls) tells what
# other processes did while this engine was idle, not what they do now: e.g. a benchmark's
# other engine, done before this one starts. Such a window is dropped; every core is used again
# and a first short window (FIRST_INTERVAL_S) measures the machine as it is.
STALE_S = 3.0
FIRST_INTERVAL_S = 0.25


def allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


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


def _own_ticks() -> int | None:
    """This process's user + system clock ticks (all its threads), or None without /proc."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None


class CpuThreadGovernor:
    """Sets torch's thread count to the allowed cores that other processes leave free.

    `max_threads`: the most threads to use (default: every CPU this process may run on).
    `adjust()` is cheap (a clock read) except about once per INTERVAL_S, when it reads /proc;
    call it between steps. Mutates torch's thread count only when the choice changes."""

    def __init__(self, max_threads: int | None = None) -> None:
        self.cpus = allowed_cpus()
        self.max_threads = max(1, min(max_threads or len(self.cpus), len(self.cpus)))
        self.ticks_per_s = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last: tuple[float, int, int] | None = None
        self._interval = FIRST_INTERVAL_S
        self.others_cores = 0.0  # the last reading: cores' worth of CPU the others took
        self._set(self.max_threads)

    def _set(self, threads: int) -> None:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self.threads = threads

    def adjust(self) -> int:
        """Re-read the machine when the interval has passed and set the thread count; returns
        the thread count in use."""
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self._interval:
            return self.threads
        busy, own = busy_ticks(self.cpus), _own_ticks()
        if busy is None or own is None:
            return self.threads
        if self._last is None or now - self._last[0] > STALE_S:
            self._set(self.max_threads)  # first call, or after an idle gap: see STALE_S
            self._interval = FIRST_INTERVAL_S
        else:
            elapsed_ticks = (now - self._last[0]) * self.ticks_per_s
            others = (busy - self._last[1]) - (own - self._last[2])
            self.others_cores = max(0.0, others / elapsed_ticks)
            free = len(self.cpus) - self.others_cores
            self._set(max(1, min(self.max_threads, int(free + SLACK_CORES))))
            self._interval = INTERVAL_S
        self._last = (now, busy, own)
        return self.threads
