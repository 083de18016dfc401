"""A histogram observed once per streamed token, made cheap: observations are counted in plain
per-bucket integers (a bisect and two additions) and added to the prometheus_client histograms
in one go, before the metrics are read (`flush()`, which `ServerMetrics.render` calls) and every
FLUSH_EVERY observations. What /metrics shows is exactly what observing each value would have
shown; the per-token cost drops from two locked histogram updates to a few hundred ns.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from typing import Any

FLUSH_EVERY = 4096  # observations between two flushes when nobody reads the metrics


class BatchedHistogram:
    """Counts observations for `children` (prometheus_client histogram children with the same
    buckets) and adds them to each on `flush()`. Any thread may call either method."""

    def __init__(self, children: list[Any]) -> None:
        self.children = children
        self._bounds = list(children[0]._upper_bounds)  # the last is +inf
        self._lock = threading.Lock()
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._pending = 0

    def observe(self, value: float, times: int = 1) -> None:
        """`times` observations of `value`."""
        index = bisect_left(self._bounds, value)  # the first bucket whose bound >= value
        with self._lock:
            self._counts[index] += times
            self._sum += value * times
            self._pending += times
            full = self._pending >= FLUSH_EVERY
        if full:
            self.flush()

    def flush(self) -> None:
        """Add what was counted since the last flush to every child histogram."""
        with self._lock:
            if not self._pending:
                return
            counts, total = self._counts, self._sum
            self._counts, self._sum, self._pending = [0] * len(self._bounds), 0.0, 0
        for child in self.children:
            child._raise_if_not_observable()
            child._sum.inc(total)
            for bucket, count in zip(child._buckets, counts, strict=True):
                if count:
                    bucket.inc(count)
