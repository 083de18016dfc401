"""EngineStats: a snapshot of the engine's gauges and cumulative counters (for metrics and logs)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

# vLLM's buckets of `vllm:iteration_tokens_total` (tokens computed in one engine step).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class IterationTokens:
    """Per-bucket counts of tokens per step (not cumulative per bucket; the exporter sums).
    Mutated by the engine thread only; `snapshot()` copies."""

    def __init__(self) -> None:
        self.counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self.sum = 0

    def observe(self, num_tokens: int) -> None:
        index = next((i for i, b in enumerate(ITERATION_TOKEN_BUCKETS) if num_tokens <= b),
                     len(ITERATION_TOKEN_BUCKETS))
        self.counts[index] += 1
        self.sum += num_tokens

    def snapshot(self) -> tuple[tuple[int, ...], int]:
        return tuple(self.counts), self.sum


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
    num_waiting_for_kv: int = 0  # of num_waiting: admitted, loading their KV from the store
    # Tokens per engine step (vLLM's iteration_tokens_total): cumulative count per bucket of
    # ITERATION_TOKEN_BUCKETS (the last entry: above all), their sum and how many steps.
    iteration_token_counts: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0
    kv_store_tiers: tuple[dict, ...] = ()  # `TierStats.to_dict()` of each KV store tier
    # Speculative decoding (vLLM's spec_decode_* counters; pagedkv/spec/stats.py): verified
    # proposals, their tokens, the tokens accepted, and acceptances by position in a proposal.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_pos: tuple[int, ...] = ()

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "prefix_cache_hit_rate": self.prefix_cache_hit_rate}


def scheduler_stats(scheduler: Any, **fields: Any) -> EngineStats:
    """EngineStats of a scheduler's queues, KV cache and counters (the engine core's and the
    simulator's, pagedkv/sim/event_log.py), plus `fields` (token totals, tiers...). Reads only."""
    kv = scheduler.kv_cache_manager
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting) + len(scheduler.loading),
        num_swapped=len(scheduler.swapped), kv_cache_usage=kv.usage,
        num_blocks=kv.num_usable_blocks, num_free_blocks=kv.num_free_blocks,
        prefix_cache_queries=scheduler.prefix_cache_queries,
        prefix_cache_hits=scheduler.prefix_cache_hits,
        num_preemptions=scheduler.num_preemptions, num_swaps=scheduler.num_swaps,
        num_pinned_blocks=kv.num_pinned_blocks, num_waiting_for_kv=len(scheduler.loading),
        **spec_decode_fields(getattr(scheduler, "spec_stats", None)), **fields)


def sum_stats(stats: Sequence[EngineStats]) -> EngineStats:
    """The cores' stats as one engine's: counts summed, KV usage over every core's blocks,
    per-bucket step counts summed, each store tier's counters summed across the cores."""
    total: dict[str, Any] = {}
    for f in dataclasses.fields(EngineStats):
        values = [getattr(s, f.name) for s in stats]
        if f.name == "kv_cache_usage":
            blocks = sum(s.num_blocks for s in stats)
            total[f.name] = (sum(s.kv_cache_usage * s.num_blocks for s in stats) / blocks
                             if blocks else 0.0)
        elif f.name == "iteration_token_counts":
            total[f.name] = tuple(sum(col) for col in zip(*values, strict=True)) \
                if all(values) else ()
        elif f.name == "spec_decode_accepted_per_pos":
            total[f.name] = tuple(map(sum, itertools.zip_longest(*values, fillvalue=0)))
        elif f.name == "kv_store_tiers":
            total[f.name] = tuple(_sum_tiers(tiers) for tiers in zip(*values, strict=True))
        else:
            total[f.name] = sum(values)
    return EngineStats(**total)


def _sum_tiers(tiers: Sequence[dict]) -> dict:
    """One tier's `to_dict()` across the cores: numbers summed, the rest (names) kept."""
    return {key: (sum(t[key] for t in tiers) if isinstance(value, (int, float))
                  and not isinstance(value, bool) else value)
            for key, value in tiers[0].items()}


def spec_decode_fields(spec: Any) -> dict[str, Any]:
    """EngineStats' spec_decode_* fields of a scheduler's SpecDecodeStats (None: none)."""
    if spec is None:
        return {}
    return {"spec_decode_num_drafts": spec.num_drafts,
            "spec_decode_num_draft_tokens": spec.num_draft_tokens,
            "spec_decode_num_accepted_tokens": spec.num_accepted_tokens,
            "spec_decode_accepted_per_pos": tuple(spec.accepted_per_pos)}
