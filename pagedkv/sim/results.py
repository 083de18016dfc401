"""A simulation's summary: latency percentiles, throughput, goodput under SLOs, prefix hits,
evictions, preemptions by kind, KV usage; as a dict (JSON), a printed table and a PNG.

`summarize(result, slo)` reads only the `SimResult`; every figure is computed from the
per-request records and the instances' counters, never estimated.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.sim.simulator import SimResult

METRICS = ("ttft", "tpot", "itl", "e2e")


@dataclass(frozen=True)
class SLO:
    """Per-request latency targets in seconds (None: no target on that metric)."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> SLO | None:
        """'ttft=2,tpot=0.1' (seconds; 'ms' suffix allowed) -> SLO; ValueError naming the bad
        part."""
        if not text:
            return None
        values: dict[str, float] = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            key = key.strip().lower()
            if not sep or key not in ("ttft", "tpot", "e2e"):
                raise ValueError(f"bad SLO part {part!r}: expected ttft=, tpot= or e2e= "
                                 "followed by seconds (or a number with 'ms')")
            value = value.strip()
            scale = 1e-3 if value.endswith("ms") else 1.0
            try:
                number = float(value.removesuffix("ms").removesuffix("s")) * scale
            except ValueError:
                raise ValueError(f"bad SLO value {value!r} for {key}") from None
            if not number > 0 or not math.isfinite(number):
                raise ValueError(f"SLO {key} must be > 0, got {value!r}")
            values[key] = number
        return cls(**values)

    def met(self, ttft: float | None, tpot: float | None, e2e: float | None) -> bool:
        """Whether a finished request met every target (one token has no TPOT: met)."""
        if self.ttft is not None and (ttft is None or ttft > self.ttft):
            return False
        if self.tpot is not None and tpot is not None and tpot > self.tpot:
            return False
        return self.e2e is None or (e2e is not None and e2e <= self.e2e)

    def to_dict(self) -> dict[str, float | None]:
        return {"ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e}


def percentile(sorted_values: Sequence[float], q: float,
               weights: Sequence[float] | None = None) -> float:
    """The q-th percentile (0..100) by nearest rank, of weighted samples when `weights`."""
    if not sorted_values:
        return float("nan")
    if weights is None:
        rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
        return sorted_values[rank - 1]
    total = sum(weights)
    target = q / 100.0 * total
    acc = 0.0
    for value, weight in zip(sorted_values, weights, strict=True):
        acc += weight
        if acc >= target:
            return value
    return sorted_values[-1]


def _stats(values: list[float], weights: list[float] | None = None) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"),
                "p99": float("nan"), "count": 0}
    if weights is None:
        values = sorted(values)
        mean = sum(values) / len(values)
        count = len(values)
    else:
        pairs = sorted(zip(values, weights, strict=True))
        values = [p[0] for p in pairs]
        weights = [p[1] for p in pairs]
        count = sum(weights)
        mean = sum(v * w for v, w in pairs) / count
    return {"mean": mean, "p50": percentile(values, 50, weights),
            "p90": percentile(values, 90, weights), "p99": percentile(values, 99, weights),
            "count": count}


def summarize(result: SimResult, slo: SLO | None = None) -> dict[str, Any]:
    """The run's figures as a JSON-ready dict (latencies in seconds)."""
    records = result.records
    done = [r for r in records if r.finish is not None and r.status in ("length", "stop")]
    ttft = [r.ttft for r in done if r.ttft is not None]
    tpot = [r.tpot for r in done if r.tpot is not None]
    e2e = [r.e2e for r in done]
    itl_values: list[float] = []
    itl_weights: list[float] = []
    for inst in result.instances:
        itl_values.extend(inst.stats.itl_values)
        itl_weights.extend(inst.stats.itl_weights)
    duration = result.duration
    out_tokens = sum(r.num_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    scheds = [inst.scheduler for inst in result.instances]
    kvs = [s.kv_cache_manager for s in scheds]
    queries = sum(s.prefix_cache_queries for s in scheds)
    hits = sum(s.prefix_cache_hits for s in scheds)
    preemptions = sum(s.num_preemptions for s in scheds)
    swaps = sum(s.num_swaps for s in scheds)
    summary: dict[str, Any] = {
        "requests": len(records), "finished": len(done),
        "rejected": sum(1 for r in records if r.status == "rejected"),
        "errors": sum(1 for r in records if r.status == "error"),
        "duration_s": duration,
        "throughput": {"requests_per_s": len(done) / duration if duration else 0.0,
                       "output_tokens_per_s": out_tokens / duration if duration else 0.0,
                       "input_tokens_per_s": in_tokens / duration if duration else 0.0},
        "latency": {"ttft": _stats(ttft), "tpot": _stats(tpot),
                    "itl": _stats(itl_values, itl_weights), "e2e": _stats(e2e)},
        "queue_time_mean": (sum(r.first_scheduled - r.arrival for r in done) / len(done)
                            if done else float("nan")),
        "prefix_cache": {"device": {"queried_tokens": queries, "hit_tokens": hits,
                                    "hit_rate": hits / queries if queries else 0.0},
                         **_store_tiers(result)},
        "evicted_blocks": sum(kv.pool.num_evicted_blocks for kv in kvs),
        "preemptions": {"total": preemptions, "recompute": preemptions - swaps,
                        "swap": swaps},
        "kv_usage": _usage(result),
        "steps": sum(i.stats.num_steps for i in result.instances),
        "jumped_steps": sum(i.stats.num_jumped_steps for i in result.instances),
        "wall_time_s": result.wall_time,
        "instances": len(result.instances), "policy": result.policy,
        "latency_model": result.latency_name,
    }
    if slo is not None:
        good = [r for r in done if slo.met(r.ttft, r.tpot, r.e2e)]
        summary["slo"] = slo.to_dict()
        summary["goodput"] = {
            "requests_per_s": len(good) / duration if duration else 0.0,
            "fraction": len(good) / len(records) if records else 0.0}
    return summary


def _store_tiers(result: SimResult) -> dict[str, dict[str, int]]:
    """Per KV store tier, over the instances: blocks hit and missed when loading, tokens hit,
    blocks written and evicted (no entry without a store)."""
    tiers: dict[str, dict[str, int]] = {}
    seen: set[int] = set()  # a tier the instances share is counted once
    for inst in result.instances:
        if inst.store is None:
            continue
        for tier in inst.store.tiers:
            if id(tier) in seen:
                continue
            seen.add(id(tier))
            t = tiers.setdefault(tier.spec.name, dict.fromkeys(
                ("hit_blocks", "hit_tokens", "missed_blocks", "blocks_written", "evicted"), 0))
            t["hit_blocks"] += tier.hits
            t["hit_tokens"] += tier.hits * result.config.block_size
            t["missed_blocks"] += tier.misses
            t["blocks_written"] += tier.blocks_written
            t["evicted"] += tier.evicted
    return tiers


def _usage(result: SimResult) -> dict[str, float]:
    means, peaks = [], []
    for inst in result.instances:
        times, values = inst.stats.usage_times, inst.stats.usage_values
        if len(values) < 2:
            continue
        area = sum((times[i + 1] - times[i]) * values[i] for i in range(len(values) - 1))
        span = times[-1] - times[0]
        means.append(area / span if span else values[0])
        peaks.append(max(values))
    return {"mean": sum(means) / len(means) if means else 0.0, "peak": max(peaks, default=0.0)}


def format_table(summary: dict[str, Any]) -> str:
    """The summary as an aligned text table (milliseconds for latencies)."""
    lines = [f"{'metric':<8} {'mean':>10} {'p50':>10} {'p90':>10} {'p99':>10}   (ms)"]
    for name in METRICS:
        s = summary["latency"][name]
        lines.append(f"{name:<8} " + " ".join(f"{s[k] * 1e3:>10.1f}" for k in
                                                ("mean", "p50", "p90", "p99")))
    t = summary["throughput"]
    pc = summary["prefix_cache"]["device"]
    p = summary["preemptions"]
    lines += [
        f"requests {summary['finished']}/{summary['requests']} finished "
        f"({summary['rejected']} rejected, {summary['errors']} errors) "
        f"over {summary['duration_s']:.1f} s simulated",
        f"throughput {t['requests_per_s']:.2f} req/s, {t['output_tokens_per_s']:.0f} output "
        f"tok/s, {t['input_tokens_per_s']:.0f} input tok/s",
        f"prefix cache (device) hit rate {pc['hit_rate']:.1%} "
        f"({pc['hit_tokens']} of {pc['queried_tokens']} tokens)",
        *(f"KV store tier {name}: {t['hit_blocks']} blocks hit ({t['hit_tokens']} tokens), "
          f"{t['missed_blocks']} missed, {t['blocks_written']} written, {t['evicted']} evicted"
          for name, t in summary["prefix_cache"].items() if name != "device"),
        f"evicted blocks {summary['evicted_blocks']}, preemptions {p['total']} "
        f"(recompute {p['recompute']}, swap {p['swap']}), KV usage mean "
        f"{summary['kv_usage']['mean']:.1%} peak {summary['kv_usage']['peak']:.1%}",
    ]
    if "goodput" in summary:
        g = summary["goodput"]
        lines.append(f"goodput {g['requests_per_s']:.2f} req/s ({g['fraction']:.1%} of "
                     f"requests meet {summary['slo']})")
    lines.append(f"simulated {summary['steps']} steps ({summary['jumped_steps']} jumped) in "
                 f"{summary['wall_time_s']:.2f} s wall")
    return "\n".join(lines)


def write_json(summary: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(summary, indent=2, default=float) + "\n", encoding="utf-8")
