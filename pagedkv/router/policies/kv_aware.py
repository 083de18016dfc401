"""kv-aware: trade the prefix a backend already holds against the work already queued on it.

For a request whose prompt has P full blocks, each candidate backend b gets a cost (lower wins),
in units of KV blocks of prefill work:

    new_blocks(b) = P - device_blocks(b) - tier_weight * tier_blocks(b)
    cost(b)       = prefill_weight * new_blocks(b)          # prefill this request needs on b
                  + load_weight    * queued_blocks(b)       # prefill queued ahead of it on b
                  + request_weight * requests(b)            # requests running/waiting on b
                  + usage_weight   * kv_usage(b)            # b's KV cache fullness, 0..1

`device_blocks(b)` is the leading run of the prompt's block hashes in b's device pool,
`tier_blocks(b)` the run after it that b can load from an offload tier (its own host/disk tier
or a shared Redis tier) -- a hit that still costs a transfer, hence `tier_weight` < 1.
`queued_blocks(b)` sums the `new_blocks` predicted for the router's requests still in flight on
b; `requests(b)` is the larger of the router's in-flight count and the backend's scraped
running + waiting (decode work and other clients); `kv_usage(b)` is the scraped
pagedkv:kv_cache_usage_perc (a full cache evicts prefixes and preempts). This is the shape of
NVIDIA Dynamo's KV router cost (overlap-weighted prefill blocks plus active blocks) with
llm-d's extra scorers folded in as weighted terms.

Imbalance guard: a backend with requests(b) > imbalance_factor * mean(requests) and more than
imbalance_slack requests above the least loaded one takes no new request while such others
exist, so one hot prefix cannot pile everything onto one backend. Ties go to the candidate with
fewer requests, then in rotation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from pagedkv.router.policies.base import Candidate, Rotation, RouteRequest


@dataclass(frozen=True)
class KVAwareWeights:
    """The weights of the cost above (defaults: a device hit block saves one block of prefill,
    a tier hit half of one, a request in flight weighs two blocks, a full cache sixteen)."""

    prefill_weight: float = 1.0
    tier_weight: float = 0.5
    load_weight: float = 1.0
    request_weight: float = 2.0
    usage_weight: float = 16.0
    imbalance_factor: float = 1.5
    imbalance_slack: float = 2.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or value < 0 or value != value:
                raise ValueError(f"{f.name} must be a non-negative number, got {value!r}")
        if self.tier_weight > 1:
            raise ValueError(f"tier_weight must be in [0, 1], got {self.tier_weight!r}")
        if self.imbalance_factor < 1:
            raise ValueError(f"imbalance_factor must be >= 1, got {self.imbalance_factor!r}")


def new_blocks(request: RouteRequest, candidate: Candidate, weights: KVAwareWeights) -> float:
    """Predicted blocks `request` would prefill on `candidate` (tier hits count partly)."""
    match = candidate.match
    return (request.prompt_blocks - match.device_blocks
            - weights.tier_weight * match.tier_blocks)


def cost(request: RouteRequest, candidate: Candidate, weights: KVAwareWeights) -> float:
    """The documented cost of placing `request` on `candidate` (lower is better)."""
    return (weights.prefill_weight * new_blocks(request, candidate, weights)
            + weights.load_weight * candidate.queued_blocks
            + weights.request_weight * candidate.requests
            + weights.usage_weight * candidate.kv_usage)


def overloaded(candidates: Sequence[Candidate], weights: KVAwareWeights) -> list[bool]:
    """The imbalance guard: which candidates are too far above the mean load to take more."""
    loads = [c.requests for c in candidates]
    mean = sum(loads) / len(loads)
    least = min(loads)
    return [load > weights.imbalance_factor * mean and load - least > weights.imbalance_slack
            for load in loads]


class KVAwarePolicy:
    name = "kv-aware"
    needs_prefix = True

    def __init__(self, weights: KVAwareWeights | None = None) -> None:
        self.weights = weights or KVAwareWeights()
        self._rotation = Rotation()

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> int:
        guard = overloaded(candidates, self.weights)
        allowed = [i for i in range(len(candidates)) if not guard[i]]
        costs = {i: cost(request, candidates[i], self.weights) for i in allowed}
        best = min(costs.values())
        tied = [i for i in allowed if costs[i] <= best + 1e-9]
        fewest = min(candidates[i].requests for i in tied)
        tied = [i for i in tied if candidates[i].requests == fewest]
        return self._rotation.pick(tied, len(candidates))
