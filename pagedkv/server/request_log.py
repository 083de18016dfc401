"""`pagedkv serve --request-log PATH`: one JSON line per finished request, a trace that
`pagedkv simulate` replays (format "request-log").

Each line: `arrival` (Unix seconds), `prompt_tokens`, `output_tokens` (the longest sample),
`block_size` and `prefix_block_hashes` (hex chained hashes of the prompt's full blocks, as the
engine's prefix cache keys them, without a cache salt), `cached_tokens`, `queue_time`, `ttft`,
`tpot`, `e2e` (seconds; null where not defined), `finish_reason`, `request_id` (the engine's), and
the engine's side of the request's timeline in seconds from its arrival (null where not
reached): `submitted` (the HTTP handler queued it for the engine loop: the frontend's own
delay), `added` (the engine loop took it, at its next round), `first_scheduled`,
`engine_first_token` and `engine_last_token` (the engine produced the first and last token;
`ttft` and `e2e` are when the server saw them).
`pagedkv profile --fit-from` fits the simulator's frontend delays to these. Written by the
server's event loop as each request finishes, one unbuffered append per line, so a crash loses
at most the line being written.

A write that fails (a full disk, an I/O error) never changes an answer: the line is dropped,
counted (`pagedkv:request_log_write_failures_total`), and logged at most once a minute; the next
line is written as soon as writes succeed again.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from pagedkv.engine.outputs import RequestOutput
from pagedkv.kv.hashing import RequestBlockHasher

logger = logging.getLogger("pagedkv.server")

FAILURE_LOG_INTERVAL_S = 60.0  # at most one warning this often while writes keep failing


class _Prompt:
    __slots__ = ("all_token_ids", "cache_salt", "lora_name")

    def __init__(self, ids: list[int]) -> None:
        self.all_token_ids = ids
        self.cache_salt = None
        self.lora_name = None


class RequestLog:
    """Appends one line per finished request to `path` (created or appended to). With a
    `registry` (the server's metrics), failed writes are counted there too."""

    def __init__(self, path: str | Path, hasher: RequestBlockHasher,
                 registry: CollectorRegistry | None = None) -> None:
        self.path = Path(path)
        self.hasher = hasher
        self._out = _FailSafeLines(self.path, registry)

    @property
    def write_failures(self) -> int:
        """Lines dropped because their write failed, since start."""
        return self._out.failures

    def record(self, output: RequestOutput, *, arrival_monotonic: float,
               submitted_monotonic: float | None = None, ttft: float | None,
               e2e: float, queue_time: float | None, num_output_tokens: int,
               finish_reason: str) -> None:
        ids = list(output.prompt_token_ids)
        hashes = self.hasher(_Prompt(ids), [])
        tpot = None
        if ttft is not None and num_output_tokens > 1:
            tpot = (e2e - ttft) / (num_output_tokens - 1)
        row: dict[str, Any] = {
            "arrival": time.time() - (time.monotonic() - arrival_monotonic),
            "prompt_tokens": len(ids), "output_tokens": num_output_tokens,
            "block_size": self.hasher.block_size,
            "prefix_block_hashes": [h.hex() for h in hashes],
            "cached_tokens": max(output.num_cached_tokens, 0), "queue_time": queue_time,
            "ttft": ttft, "tpot": tpot, "e2e": e2e, "finish_reason": finish_reason,
            "request_id": output.request_id,
            "submitted": (None if submitted_monotonic is None
                          else submitted_monotonic - arrival_monotonic),
            **_engine_timeline(output.metrics or {}, arrival_monotonic),
        }
        self._out.write(row)

    def close(self) -> None:
        self._out.close()


class _FailSafeLines:
    """Appends JSON lines to a file with one os.write each (O_APPEND: nothing stays buffered
    behind a failed write); a write's OSError drops its line, counts it and is logged
    rate-limited. Thread-safe; lines written after `close()` are dropped."""

    def __init__(self, path: Path, registry: CollectorRegistry | None) -> None:
        self.path = path
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()
        self.failures = 0
        self._failing = False  # the last write failed
        self._unreported = 0  # failures since the last warning
        self._last_warning = -float("inf")
        self._counter = None if registry is None else Counter(
            "pagedkv:request_log_write_failures", "Request-log lines dropped because their "
            "write failed (a full disk, an I/O error); the answers were not affected",
            registry=registry)

    def write(self, row: dict[str, Any]) -> None:
        data = (json.dumps(row, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._fd is None:
                return
            try:
                while data:
                    data = data[os.write(self._fd, data):]
            except OSError as exc:
                self._failed(exc)
                return
            if self._failing:
                self._resumed()

    def _failed(self, exc: OSError) -> None:
        self.failures += 1
        self._failing = True
        self._unreported += 1
        if self._counter is not None:
            self._counter.inc()
        now = time.monotonic()
        if now - self._last_warning >= FAILURE_LOG_INTERVAL_S:
            logger.warning("--request-log %s: a write failed (%s); %d line(s) dropped since the "
                           "last warning (%d in all); the answers are not affected",
                           self.path, exc.strerror or exc, self._unreported, self.failures)
            self._last_warning = now
            self._unreported = 0

    def _resumed(self) -> None:
        logger.warning("--request-log %s: writes succeed again (%d line(s) dropped in all)",
                       self.path, self.failures)
        self._failing = False
        self._unreported = 0
        self._last_warning = -float("inf")  # a new failure is told at once

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _engine_timeline(times: dict[str, float], arrival: float) -> dict[str, float | None]:
    """The engine's monotonic times of a request (RequestOutput.metrics; 0 = not reached) as
    seconds from the server's `arrival` (time.monotonic())."""
    def since(key: str) -> float | None:
        value = times.get(key) or 0.0
        return value - arrival if value else None

    return {"added": since("arrival_time"), "first_scheduled": since("first_scheduled_time"),
            "engine_first_token": since("first_token_time"),
            "engine_last_token": since("last_token_time")}
