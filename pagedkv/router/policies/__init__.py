"""Routing policies, by the name `pagedkv router --policy` takes."""

from __future__ import annotations

from pagedkv.router.policies.base import Candidate, RouteRequest, RoutingPolicy
from pagedkv.router.policies.kv_aware import KVAwarePolicy, KVAwareWeights
from pagedkv.router.policies.least_load import LeastLoadPolicy
from pagedkv.router.policies.round_robin import RoundRobinPolicy
from pagedkv.router.policies.session import SessionPolicy

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
