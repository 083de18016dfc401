"""The router's recent routing decisions, for its dashboard (issue 23): a bounded ring.

`Router.route` records each decision: when, the request's prompt blocks, session and first
block hash (which shared prefix it starts with), the backend chosen, and every candidate's
snapshot with its score (the KV-aware policy's cost, lower is better; None for policies that
do not score). Mutated from the router's event loop only.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from pagedkv.router.policies.base import Candidate, RouteRequest
from pagedkv.router.policies.kv_aware import KVAwarePolicy, KVAwareWeights, cost

DEFAULT_DECISIONS = 256


class RoutingDecisions:
    """The newest `capacity` decisions, oldest first. `record` keeps the snapshots as they are
    (frozen dataclasses, a few words per request on the hot path); `records` spells them out
    for the dashboard when it asks."""

    def __init__(self, capacity: int = DEFAULT_DECISIONS) -> None:
        self._raw: deque[tuple[float, str, KVAwareWeights | None, RouteRequest,
                               tuple[Candidate, ...], int]] = deque(maxlen=capacity)
        self.total = 0

    def record(self, policy: Any, request: RouteRequest, candidates: Sequence[Candidate],
               chosen: int) -> None:
        """Append one decision (`policy` chose `candidates[chosen]`)."""
        weights = policy.weights if isinstance(policy, KVAwarePolicy) else None
        self.total += 1
        self._raw.append((time.time(), policy.name, weights, request, tuple(candidates), chosen))

    @property
    def records(self) -> list[dict[str, Any]]:
        """The decisions as JSON-ready dicts (new ones, oldest first)."""
        return [_spelled_out(*raw) for raw in self._raw]


def _spelled_out(when: float, policy: str, weights: KVAwareWeights | None,
                 request: RouteRequest, candidates: tuple[Candidate, ...],
                 chosen: int) -> dict[str, Any]:
    return {
        "time": when, "policy": policy, "chosen": candidates[chosen].name,
        "prompt_tokens": request.prompt_tokens, "prompt_blocks": request.prompt_blocks,
        "session": request.session,
        "prefix": request.block_hashes[0][:8].hex() if request.block_hashes else None,
        "candidates": [{
            "name": c.name, "in_flight": c.in_flight, "queued_blocks": c.queued_blocks,
            "running": c.running, "waiting": c.waiting, "kv_usage": c.kv_usage,
            "device_blocks": c.match.device_blocks, "tier_blocks": c.match.tier_blocks,
            "turnover": c.turnover,
            "score": None if weights is None else cost(request, c, weights)}
            for c in candidates],
    }
