"""kv-aware: trade the prefix a backend already holds against the work already queued on it.

For a request whose prompt has P full blocks, each candidate backend b gets a cost (lower wins),
in units of KV blocks of prefill work:

    new_blocks(b) = P - device_blocks(b) - tier_weight * tier_blocks(b)
    cost(b)       = prefill_weight * new_blocks(b)          # prefill this request needs on b
                  + eviction_weight * turnover(b) * new_blocks(b)  # cached blocks it evicts
                  + load_weight    * queued_blocks(b)       # prefill queued ahead of it on b
                  + request_weight * requests(b)            # requests running/waiting on b
                  + usage_weight   * kv_usage(b)            # b's KV cache fullness, 0..1

`device_blocks(b)` is the leading run of the prompt's block hashes in b's device pool,
`tier_blocks(b)` the run after it that b can load from an offload tier (its own host/disk tier
or a shared Redis tier) -- a hit that still costs a transfer, hence `tier_weight` < 1.
`queued_blocks(b)` sums the `new_blocks` predicted for the router's requests still in flight on
b; `requests(b)` is the larger of the router's in-flight count and the backend's scraped
running + waiting (decode work and other clients); `kv_usage(b)` is the scraped
pagedkv:kv_cache_usage_perc (a full cache evicts prefixes and preempts). `turnover(b)` is how
fast b's cache is being rewritten: the new blocks the router sent it over about the last
`turnover_window_s` seconds (an exponentially decaying sum), over its pool size (0 while that is
unknown, e.g. a vLLM backend). Every new block a request writes into a full cache evicts a
cached one, and on a cache that turns over within the window the evicted block is young, so
likely still wanted: a prompt no backend holds (a new conversation) goes where its blocks
evict the least and live the longest, while a prompt a backend holds keeps its affinity (few
new blocks, a small term). Without it, cold prompts follow the request counts, and backends
whose conversations run long thrash their caches while others' sit cold. This is the shape of
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

from pagedkv.engine.placement.base import Candidate, Rotation, RouteRequest


@dataclass(frozen=True)
class KVAwareWeights:
    """The weights of the cost above (defaults: a device hit block saves one block of prefill,
    a tier hit half of one, a request in flight weighs two blocks, a full cache sixteen, a new
    block on a cache rewritten once per 30 s one more)."""

    prefill_weight: float = 1.0
    tier_weight: float = 0.5
    load_weight: float = 1.0
    request_weight: float = 2.0
    usage_weight: float = 16.0
    eviction_weight: float = 1.0
    turnover_window_s: float = 30.0
    imbalance_factor: float = 1.5
    imbalance_slack: float = 2.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or value < 0 or value != value:
                raise ValueError(f"{f.name} must be a non-negative number, got {value!r}")
        if self.tier_weight > 1:
            raise ValueError(f"tier_weight must be in [0, 1], got {self.tier_weight!r}")
        if self.turnover_window_s <= 0:
            raise ValueError(f"turnover_window_s must be positive, got {self.turnover_window_s!r}")
        if self.imbalance_factor < 1:
            raise ValueError(f"imbalance_factor must be >= 1, got {self.imbalance_factor!r}")


def new_blocks(request: RouteRequest, candidate: Candidate, weights: KVAwareWeights) -> float:
    """Predicted blocks `request` would prefill on `candidate` (tier hits count partly)."""
    match = candidate.match
    return (request.prompt_blocks - match.device_blocks
            - weights.tier_weight * match.tier_blocks)


def cost(request: RouteRequest, candidate: Candidate, weights: KVAwareWeights) -> float:
    """The documented cost of placing `request` on `candidate` (lower is better)."""
    new = new_blocks(request, candidate, weights)
    return (weights.prefill_weight * new
            + weights.eviction_weight * candidate.turnover * new
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
