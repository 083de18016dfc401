"""Placement policies: which of several backends (router) or engine cores (data parallel)
takes a request, by the name `pagedkv router --policy` takes. Pure: no HTTP, no engine."""

from __future__ import annotations

from pagedkv.engine.placement.base import Candidate, RouteRequest, RoutingPolicy
from pagedkv.engine.placement.kv_aware import KVAwarePolicy, KVAwareWeights
from pagedkv.engine.placement.least_load import LeastLoadPolicy
from pagedkv.engine.placement.round_robin import RoundRobinPolicy
from pagedkv.engine.placement.session import SessionPolicy

POLICY_NAMES = ("kv-aware", "round-robin", "least-load", "session")


def make_policy(name: str, weights: KVAwareWeights | None = None) -> RoutingPolicy:
    """A fresh policy called `name` (`weights` only matter for kv-aware)."""
    if name == "kv-aware":
        return KVAwarePolicy(weights)
    if name == "round-robin":
        return RoundRobinPolicy()
    if name == "least-load":
        return LeastLoadPolicy()
    if name == "session":
        return SessionPolicy()
    raise ValueError(f"unknown routing policy {name!r}; choose one of {list(POLICY_NAMES)}")


__all__ = ["POLICY_NAMES", "Candidate", "KVAwarePolicy", "KVAwareWeights", "RouteRequest",
           "RoutingPolicy", "make_policy"]
