"""decode-room: where a disaggregated request decodes, by load and KV room.

A decode instance holds every running request's KV for its whole life, so the choice weighs
its requests against how full its cache is: cost = requests(b) + usage_weight * kv_usage(b)
(`Candidate.requests`: the larger of the router's in-flight count and the backend's own
running + waiting; `kv_usage`: its scraped pagedkv:kv_cache_usage_perc, 0..1). A backend at
`full_usage` or above takes nothing new while one with room exists (the transferred prompt
would preempt a running request there). Prefix hits do not count: the prompt's KV arrives from
the prefill instance. Ties go to fewer requests, then in rotation. The simulator places its
decode requests with the same object.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.router.policies.base import Candidate, Rotation, RouteRequest

DEFAULT_USAGE_WEIGHT = 8.0  # a full cache weighs as much as eight requests
DEFAULT_FULL_USAGE = 0.95


class DecodeRoomPolicy:
    name = "decode-room"
    needs_prefix = False

    def __init__(self, usage_weight: float = DEFAULT_USAGE_WEIGHT,
                 full_usage: float = DEFAULT_FULL_USAGE) -> None:
        if not usage_weight >= 0:
            raise ValueError(f"usage_weight must be >= 0, got {usage_weight!r}")
        if not 0 < full_usage <= 1:
            raise ValueError(f"full_usage must be in (0, 1], got {full_usage!r}")
        self.usage_weight = usage_weight
        self.full_usage = full_usage
        self._rotation = Rotation()

    def cost(self, candidate: Candidate) -> float:
        return candidate.requests + self.usage_weight * candidate.kv_usage

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> int:
        roomy = [i for i, c in enumerate(candidates) if c.kv_usage < self.full_usage]
        pool = roomy or list(range(len(candidates)))
        best = min(self.cost(candidates[i]) for i in pool)
        tied = [i for i in pool if self.cost(candidates[i]) <= best + 1e-9]
        fewest = min(candidates[i].requests for i in tied)
        tied = [i for i in tied if candidates[i].requests == fewest]
        return self._rotation.pick(tied, len(candidates))
