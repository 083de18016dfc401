"""session: requests with the same session key go to the same backend (rendezvous hashing).

The key is the `X-Session-ID` header, else the body's `user` field. Each candidate gets the
score sha256(key, backend name) and the highest wins, so when a backend goes down only its own
sessions move, and they come back when it returns. Requests without a key go to the least
loaded backend.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.engine.placement.base import (
    Candidate,
    Rotation,
    RouteRequest,
    least_requests,
    stable_digest,
)


class SessionPolicy:
    name = "session"
    needs_prefix = False

    def __init__(self) -> None:
        self._rotation = Rotation()

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> int:
        if request.session is None:
            return self._rotation.pick(least_requests(candidates), len(candidates))
        scores = [stable_digest(request.session, c.name) for c in candidates]
        return max(range(len(candidates)), key=scores.__getitem__)
