"""round-robin: each request to the next backend in turn (the baseline)."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.engine.placement.base import Candidate, Rotation, RouteRequest


class RoundRobinPolicy:
    name = "round-robin"
    needs_prefix = False

    def __init__(self) -> None:
        self._rotation = Rotation()

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> int:
        return self._rotation.pick(range(len(candidates)), len(candidates))
