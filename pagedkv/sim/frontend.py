"""The serving frontend's delays around the engine, which a step-time model does not cover.

A request's latencies are measured by the server from when its HTTP handler started
(`pagedkv serve --request-log`), not from when the engine loop took it, and end when the
server's event loop sees the token, not when the engine step produced it:

- `admit`: from the handler's start until it queues the request for the engine loop (checks,
  the tokenizer thread's hop, the sampling parameters; on a busy server the event loop waits
  for the GIL behind the engine thread). The engine then takes it at its next step, which the
  simulator models itself (a request arriving mid-step waits for the step's end);
- `output`: from the engine's output of the first token until the event loop has it (the
  hand-over between threads), added to each request's first-token time;
- `finish`: the same for the last token, which also finishes the request (it can differ from
  `output`: at the first token the engine thread goes straight on to the next step, at the
  last it may fall idle), added to its last-token and finish times; TPOT counts the
  difference, as the server's does;
- `wake`: from a request reaching an idle engine loop until its first step starts (the loop
  thread wakes and takes every request queued by then). Requests of a burst that reach the
  engine within `wake` of the first join its first step: without it the simulator starts
  that step at once and the rest of the burst waits a whole step, which moves every later
  batch (in the benchmark's Mooncake slice a 0.7 ms wake decided whether a burst's second
  request, 0.3 ms behind the first, shared its prefill step).

All are fitted as medians over a real run's request log (`submitted`, `ttft` less
`engine_first_token`, `e2e` less `engine_last_token`; `wake`: `first_scheduled` less
`submitted` of the requests that found the engine idle). Zero delays (the default) leave the
simulator's times the engine's. Torch-free.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class FrontendDelays:
    """Seconds the serving frontend adds before a request reaches the engine (`admit`),
    after the engine produces its first token (`output`) and its last (`finish`), and before
    an idle engine loop starts its first step for a request (`wake`)."""

    admit: float = 0.0
    output: float = 0.0
    finish: float = 0.0
    wake: float = 0.0

    def __post_init__(self) -> None:
        for name in _FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"frontend delay {name} must be a finite number of seconds "
                                 f">= 0, got {value!r}")

    @property
    def is_zero(self) -> bool:
        return all(getattr(self, name) == 0.0 for name in _FIELDS)

    @classmethod
    def fit(cls, rows: Iterable[Mapping[str, Any]]) -> FrontendDelays:
        """Medians over request-log rows (dicts); rows without the timeline fields (a log
        from before they existed) are skipped. ValueError when no row has them."""
        rows = list(rows)
        spans: dict[str, list[float]] = {"admit": [], "output": [], "finish": []}
        for row in rows:
            for name, end, start in (("admit", "submitted", None),
                                     ("output", "ttft", "engine_first_token"),
                                     ("finish", "e2e", "engine_last_token")):
                if row.get(end) is not None and (start is None or row.get(start) is not None):
                    spans[name].append(float(row[end]) - (float(row[start]) if start else 0.0))
        if not all(spans.values()):
            raise ValueError("the request log has no frontend timeline (`submitted`, "
                             "`engine_first_token`, `engine_last_token`): it was written "
                             "before they existed")
        wakes = _idle_wakes(rows)
        spans["wake"] = wakes or [0.0]
        return cls(**{name: max(0.0, statistics.median(v)) for name, v in spans.items()})

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> FrontendDelays:
        """From `to_dict()`'s shape; ValueError naming what is wrong."""
        if not isinstance(data, dict) or set(data) - set(_FIELDS):
            raise ValueError("frontend delays must be {'admit': s, 'output': s, 'finish': s, "
                             f"'wake': s}}, got {data!r}")
        return cls(**data)


_FIELDS = tuple(f.name for f in fields(FrontendDelays))
NO_DELAYS = FrontendDelays()


def _idle_wakes(rows: Iterable[Mapping[str, Any]]) -> list[float]:
    """`first_scheduled - submitted` of each request-log row that reached an idle engine: every
    row submitted before it had its last token already (times are seconds from each row's
    Unix `arrival`; rows without the fields are left out)."""
    keys = ("arrival", "submitted", "first_scheduled", "engine_last_token")
    timed = sorted((float(r["arrival"]) + float(r["submitted"]),
                    float(r["first_scheduled"]) - float(r["submitted"]),
                    float(r["arrival"]) + float(r["engine_last_token"]))
                   for r in rows if all(r.get(k) is not None for k in keys))
    wakes = []
    busy_until = -math.inf
    for submitted, wake, last_token in timed:
        if busy_until < submitted:
            wakes.append(wake)
        busy_until = max(busy_until, last_token)
    return wakes


def frontend_of(latency: object) -> FrontendDelays:
    """The frontend delays a latency model carries (a fitted model's `frontend`), else none."""
    delays = getattr(latency, "frontend", None)
    return delays if isinstance(delays, FrontendDelays) else NO_DELAYS


def observed(records: Iterable[Any], delays: FrontendDelays) -> None:
    """Shift each record's first-token time (the engine's) to when the server sees it
    (`delays.output` later), and its last-token and finish times `delays.finish` later.
    Mutates the records; ITL is unchanged."""
    if not delays.output and not delays.finish:
        return
    for r in records:
        if r.first_token is not None:
            r.first_token += delays.output
        if r.last_token is not None:
            r.last_token += delays.finish
        if r.finish is not None:
            r.finish += delays.finish
