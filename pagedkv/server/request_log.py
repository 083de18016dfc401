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
server's event loop as each request finishes, line-buffered, so a crash loses at most the line
being written.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pagedkv.engine.outputs import RequestOutput
from pagedkv.jsonl import JsonLinesWriter
from pagedkv.kv.hashing import RequestBlockHasher


class _Prompt:
    __slots__ = ("all_token_ids", "cache_salt", "lora_name")

    def __init__(self, ids: list[int]) -> None:
        self.all_token_ids = ids
        self.cache_salt = None
        self.lora_name = None


class RequestLog:
    """Appends one line per finished request to `path` (created or appended to)."""

    def __init__(self, path: str | Path, hasher: RequestBlockHasher) -> None:
        self.path = Path(path)
        self.hasher = hasher
        self._out = JsonLinesWriter(self.path)

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


def _engine_timeline(times: dict[str, float], arrival: float) -> dict[str, float | None]:
    """The engine's monotonic times of a request (RequestOutput.metrics; 0 = not reached) as
    seconds from the server's `arrival` (time.monotonic())."""
    def since(key: str) -> float | None:
        value = times.get(key) or 0.0
        return value - arrival if value else None

    return {"added": since("arrival_time"), "first_scheduled": since("first_scheduled_time"),
            "engine_first_token": since("first_token_time"),
            "engine_last_token": since("last_token_time")}
