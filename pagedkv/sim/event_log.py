"""`pagedkv simulate --event-log PATH`: the simulated engine's block feed, recorded in the log
format the dashboard saves ("save log") and replays ("replay log"), so a simulated run can be
replayed beside a live one.

The log is `{"snapshot": ..., "updates": [...]}`: the snapshot a newly connected page gets, then
one update every `period_s` of simulated time (the live feed's 10 a second), each with the
block ops since the last one, the stats and the queues (pagedkv/engine/block_feed.py makes all
three, for the engine and for this). Times are the simulated clock plus `start_time` (the wall
time the simulation started), so the page's clock and rates read as in a live run. At most
`max_updates` updates are kept (the log says `"truncated": true` past that).

Only instance 0 is recorded (one engine, as one dashboard shows).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pagedkv.engine.block_feed import BlockFeed
from pagedkv.engine.stats import EngineStats, scheduler_stats

DEFAULT_PERIOD_S = 0.1
DEFAULT_MAX_UPDATES = 36_000  # an hour of simulated time at 10 updates a second


class _Totals:
    """Cumulative token and TTFT counts of one instance's records, kept incrementally."""

    def __init__(self) -> None:
        self.seen_finished = 0
        self.done = {"prompt_tokens": 0, "generation_tokens": 0, "ttft_sum": 0.0, "ttft_count": 0}

    def read(self, instance: Any) -> dict[str, Any]:
        """The totals now (finished records are folded in once; live ones are summed)."""
        done = self.done
        for record in instance.finished[self.seen_finished:]:
            _add(done, record)
        self.seen_finished = len(instance.finished)
        now = dict(done)
        for record in instance.live.values():
            _add(now, record)
        return now


def _add(totals: dict[str, Any], record: Any) -> None:
    if record.first_token is not None:
        totals["prompt_tokens"] += record.prompt_tokens
        totals["ttft_sum"] += record.ttft
        totals["ttft_count"] += 1
    totals["generation_tokens"] += record.num_tokens


class _InstanceView:
    """What BlockFeed reads of an engine (`scheduler`, `get_stats()`), over a SimInstance."""

    def __init__(self, instance: Any) -> None:
        self.instance = instance
        self.scheduler = instance.scheduler
        self.totals = _Totals()
        self.extra: dict[str, Any] = {}

    def get_stats(self) -> EngineStats:
        """The scheduler's gauges and counters; `extra` gets the TTFT totals (mutated)."""
        totals = self.totals.read(self.instance)
        self.extra = {"ttft_sum": totals["ttft_sum"], "ttft_count": totals["ttft_count"]}
        return scheduler_stats(self.scheduler, prompt_tokens=totals["prompt_tokens"],
                               generation_tokens=totals["generation_tokens"])


class SimEventLog:
    """Records one SimInstance's block feed (see the module docstring). `attach` wraps the
    instance's `step` (on that instance only); `write` saves the log."""

    def __init__(self, period_s: float = DEFAULT_PERIOD_S,
                 max_updates: int = DEFAULT_MAX_UPDATES, start_time: float | None = None) -> None:
        if not period_s > 0:
            raise ValueError(f"period_s must be positive, got {period_s!r}")
        if not isinstance(max_updates, int) or max_updates < 1:
            raise ValueError(f"max_updates must be a positive integer, got {max_updates!r}")
        self.period_s = period_s
        self.max_updates = max_updates
        self.start_time = time.time() if start_time is None else start_time
        self.snapshot: dict[str, Any] | None = None
        self.updates: list[dict[str, Any]] = []
        self.truncated = False
        self._view: _InstanceView | None = None
        self._feed = BlockFeed()
        self._sub = 0
        self._next = 0.0

    def attach(self, instance: Any) -> None:
        """Start recording `instance` (its first one only; later calls are ignored): takes the
        snapshot and replaces `instance.step` with a recording wrapper."""
        if self._view is not None:
            return
        self._view = _InstanceView(instance)
        self._sub, snap = self._feed.subscribe(self._view)
        snap["t"] = self.start_time + instance.clock
        snap["model"] = "simulated"
        self.snapshot = snap
        self._next = instance.clock + self.period_s
        step = instance.step

        def recording_step(*args: Any, **kwargs: Any) -> bool:
            ran = step(*args, **kwargs)
            if instance.clock >= self._next:
                self.record()
            return ran
        instance.step = recording_step

    def record(self) -> None:
        """Drain the ops since the last update into a new update, stamped with the instance's
        clock (call it at the end, too, for the final state)."""
        view = self._view
        if view is None or self.truncated:
            return
        if len(self.updates) >= self.max_updates:
            self.truncated = True
            self._feed.unsubscribe(view, self._sub)  # stop recording: no cost from here on
            return
        update = self._feed.drain(view, self._sub)
        clock = view.instance.clock
        update["t"] = update["stats"]["time"] = self.start_time + clock
        update["stats"].update(view.extra)
        self.updates.append(update)
        self._next = clock + self.period_s

    def write(self, path: str | Path) -> None:
        """Record the final state, then save the log as JSON at `path`."""
        self.record()
        if self.snapshot is None:
            raise ValueError("no simulated instance was recorded")
        log = {"snapshot": self.snapshot, "updates": self.updates, "truncated": self.truncated,
               "source": "pagedkv simulate"}
        Path(path).write_text(json.dumps(log, separators=(",", ":")), encoding="utf-8")
