"""Routing policies, by the name `pagedkv router --policy` takes. They are pure placement
logic, shared with the data-parallel front end, so they live in `pagedkv.engine.placement`;
this package names them for the router."""

from __future__ import annotations

from pagedkv.engine.placement import (
    POLICY_NAMES,
    Candidate,
    KVAwarePolicy,
    KVAwareWeights,
    RouteRequest,
    RoutingPolicy,
    make_policy,
)

__all__ = ["POLICY_NAMES", "Candidate", "KVAwarePolicy", "KVAwareWeights", "RouteRequest",
           "RoutingPolicy", "make_policy"]
