"""What every routing policy sees (`pagedkv.engine.placement.base`)."""

from __future__ import annotations

from pagedkv.engine.placement.base import (
    Candidate,
    Rotation,
    RouteRequest,
    RoutingPolicy,
    least_requests,
    stable_digest,
)

__all__ = ["Candidate", "Rotation", "RouteRequest", "RoutingPolicy", "least_requests",
           "stable_digest"]
