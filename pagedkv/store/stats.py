"""Per-tier store counters and latency histograms (read by metrics and benchmarks)."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5)


@dataclass
class LatencyHistogram:
    """Cumulative-style histogram: `counts[i]` observations <= `buckets[i]`, last is +Inf."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    sum: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.sum += seconds
        self.count += 1

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else 0.0

    def to_dict(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum,
                "count": self.count}


@dataclass
class TierStats:
    """Counts in blocks and bytes since the store was built; `lock` guards every update."""

    name: str
    medium: str
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    load_seconds: LatencyHistogram = field(default_factory=LatencyHistogram)
    save_seconds: LatencyHistogram = field(default_factory=LatencyHistogram)
    used_bytes: int = 0
    num_blocks: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def to_dict(self) -> dict:
        """A plain snapshot (taken under the lock): counters, usage and both histograms."""
        with self.lock:
            return {"name": self.name, "medium": self.medium, "hits": self.hits,
                    "misses": self.misses, "bytes_read": self.bytes_read,
                    "bytes_written": self.bytes_written, "blocks_written": self.blocks_written,
                    "used_bytes": self.used_bytes, "num_blocks": self.num_blocks,
                    "load_seconds": self.load_seconds.to_dict(),
                    "save_seconds": self.save_seconds.to_dict()}
