"""least-load: the backend with the fewest requests (`Candidate.requests`), ties in rotation."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.engine.placement.base import Candidate, Rotation, RouteRequest, least_requests


class LeastLoadPolicy:
    name = "least-load"
    needs_prefix = False

    def __init__(self) -> None:
        self._rotation = Rotation()

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> int:
        return self._rotation.pick(least_requests(candidates), len(candidates))
