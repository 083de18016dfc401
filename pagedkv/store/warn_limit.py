"""RateLimitedWarning: a warning that repeats on every failure of a kind (a full disk, a
corrupt block) logged at most once per interval, saying how many happened since the last one."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

WARNING_INTERVAL_S = 60.0


class RateLimitedWarning:
    """`note(message, *args)` counts one occurrence and logs `message % args` plus the counts
    when the last warning is older than `interval_s` (the first one always)."""

    def __init__(self, logger: logging.Logger, what: str,
                 interval_s: float = WARNING_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.what = what  # the occurrences' name in the counts ("block write(s) failed")
        self.interval_s = interval_s
        self.clock = clock  # a seam for tests
        self.total = 0
        self._unwarned = 0
        self._last: float | None = None
        self._lock = threading.Lock()

    def note(self, message: str, *args: object) -> None:
        with self._lock:
            self.total += 1
            self._unwarned += 1
            now = self.clock()
            if self._last is not None and now - self._last < self.interval_s:
                return
            self._last = now
            count, self._unwarned = self._unwarned, 0
        self.logger.warning(message + "; %d %s since the last warning (%d in all)",
                            *args, count, self.what, self.total)
