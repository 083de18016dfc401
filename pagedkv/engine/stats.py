"""EngineStats: a snapshot of the engine's gauges and cumulative counters (for metrics and logs)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class EngineStats:
    """Gauges are the state now; `*_total`-style fields are cumulative since the engine started.

    `kv_cache_usage` is the fraction of usable device blocks that requests hold; cached blocks
    that no request holds count as free (as in vLLM). Prefix-cache queries and hits count tokens.
    """

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_cache_usage: float = 0.0
    num_blocks: int = 0
    num_free_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_swaps: int = 0  # the preemptions that swapped out to host blocks (the rest recompute)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_pinned_blocks: int = 0  # device blocks held by pinned prefixes
    kv_store_tiers: tuple[dict, ...] = ()  # `TierStats.to_dict()` of each KV store tier

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "prefix_cache_hit_rate": self.prefix_cache_hit_rate}
