"""What every routing policy sees: the request to place and a snapshot of each candidate backend.

A policy is a class with `choose(request, candidates) -> int` (an index into `candidates`, which
is never empty and holds only backends that are up and not yet tried for this request). Policies
are pure: everything they read is in their arguments, apart from their own rotation counter, so
they are unit-tested without a network. A new policy is a new file registered in `__init__.py`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pagedkv.engine.placement.prefix_index import PrefixMatch


@dataclass(frozen=True)
class RouteRequest:
    """The request being placed: its prompt length, its prompt's chained block hashes (empty
    when the router cannot tokenize it), a session key (None when it has none) and the model
    it names (None when it names none: any backend may serve it)."""

    prompt_tokens: int = 0
    block_hashes: tuple[bytes, ...] = ()
    session: str | None = None
    model: str | None = None

    @property
    def prompt_blocks(self) -> int:
        """Full blocks of the prompt (the ones that can be cached)."""
        return len(self.block_hashes)


@dataclass(frozen=True)
class Candidate:
    """A snapshot of one backend when the request is placed.

    `in_flight`: requests the router has sent there and that have not finished.
    `queued_blocks`: the predicted prefill blocks of those requests (work queued ahead).
    `running`, `waiting`, `kv_usage`: the backend's own gauges, from its last /metrics scrape
    (they also count requests other clients sent). `match`: the request's prefix on it.
    `turnover`: how fast its cache is being rewritten: the new blocks the router sent it over
    the recent window, over its pool size (0 when that is unknown; see kv_aware.py).
    """

    name: str
    in_flight: int = 0
    queued_blocks: float = 0.0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    match: PrefixMatch = field(default_factory=PrefixMatch)
    turnover: float = 0.0

    @property
    def requests(self) -> int:
        """Requests on the backend: the larger of the router's count and the backend's own
        (which lags by a scrape but includes other clients)."""
        return max(self.in_flight, self.running + self.waiting)


class RoutingPolicy(Protocol):
    name: str
    needs_prefix: bool  # True when `choose` reads `Candidate.match` (the router then computes it)

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> int: ...


class Rotation:
    """Breaks ties fairly: among tied indices, the one after the last pick, in rotation."""

    def __init__(self) -> None:
        self._counter = 0

    def pick(self, tied: Sequence[int], num_candidates: int) -> int:
        start = self._counter % max(num_candidates, 1)
        self._counter += 1
        return min(tied, key=lambda i: (i - start) % num_candidates)


def least_requests(candidates: Sequence[Candidate]) -> list[int]:
    """Indices of the candidates with the fewest requests."""
    fewest = min(c.requests for c in candidates)
    return [i for i, c in enumerate(candidates) if c.requests == fewest]


def stable_digest(*parts: str) -> int:
    """A process-independent 64-bit number of `parts` (sha256, never Python's hash())."""
    data = "\x00".join(parts).encode("utf-8")
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")
