"""Sweeps over one setting and SLO capacity search, both by re-running the simulator.

A setting is a `SimConfig` field (`num_blocks`, `block_size`, `eviction_policy`,
`preemption_mode`, `max_num_seqs`, ...) or `instances`. `capacity_search` finds the fewest
blocks or instances whose run has at least `target` of the trace's requests meeting the SLO at
the trace's own rate (bisection over blocks, doubling then bisection over instances: more of
either never makes latency worse in this model).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from pagedkv.sim.config import SimConfig
from pagedkv.sim.latency.base import LatencyModel
from pagedkv.sim.results import SLO, summarize
from pagedkv.sim.simulator import SimResult, simulate
from pagedkv.sim.traces import TraceRequest

SWEEPABLE = ("instances", *(f.name for f in dataclasses.fields(SimConfig)
                            if f.name not in ("jump", "store_tiers", "block_bytes")))


def parse_sweep(text: str) -> tuple[str, list[Any]]:
    """'num_blocks=1000,2000' -> ('num_blocks', [1000, 2000]); values typed like the field."""
    name, sep, values = text.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or name not in SWEEPABLE or not values.strip():
        raise ValueError(f"bad --sweep {text!r}: expected SETTING=V1,V2,... with SETTING one of "
                         f"{list(SWEEPABLE)}")
    default = 1 if name == "instances" else getattr(SimConfig(num_blocks=2), name)
    parsed = []
    for value in values.split(","):
        value = value.strip()
        try:
            if isinstance(default, bool):
                parsed.append(value.lower() in ("1", "true", "yes", "on"))
            elif isinstance(default, int) or name in ("sliding_window",):
                parsed.append(int(value))
            elif isinstance(default, float):
                parsed.append(float(value))
            else:
                parsed.append(value)
        except ValueError:
            raise ValueError(f"bad --sweep value {value!r} for {name}") from None
    return name, parsed


def run_with(trace: Sequence[TraceRequest], config: SimConfig, latency: LatencyModel,
             setting: str, value: Any, *, num_instances: int = 1,
             policy: str = "round-robin") -> SimResult:
    """One run with `setting` = `value` (the rest of `config` unchanged)."""
    if setting == "instances":
        return simulate(trace, config, latency, num_instances=int(value), policy=policy)
    return simulate(trace, dataclasses.replace(config, **{setting: value}), latency,
                    num_instances=num_instances, policy=policy)


def sweep(trace: Sequence[TraceRequest], config: SimConfig, latency: LatencyModel,
          setting: str, values: Sequence[Any], *, slo: SLO | None = None,
          num_instances: int = 1, policy: str = "round-robin") -> list[dict[str, Any]]:
    """One summary per value, each with the swept `setting` and `value` added."""
    rows = []
    for value in values:
        result = run_with(trace, config, latency, setting, value, num_instances=num_instances,
                          policy=policy)
        rows.append({"setting": setting, "value": value, **summarize(result, slo)})
    return rows


def meets(summary: dict[str, Any], target: float) -> bool:
    return summary["goodput"]["fraction"] >= target


def capacity_search(trace: Sequence[TraceRequest], config: SimConfig, latency: LatencyModel,
                    slo: SLO, *, setting: str = "num_blocks", target: float = 0.99,
                    low: int | None = None, high: int | None = None, num_instances: int = 1,
                    policy: str = "round-robin",
                    log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The fewest `setting` (num_blocks or instances) meeting `slo` for `target` of the
    requests. Returns {"setting", "value" (None when even `high` fails), "summary", "tried"}."""
    if setting not in ("num_blocks", "instances"):
        raise ValueError(f"capacity search is over num_blocks or instances, got {setting!r}")
    if not 0 < target <= 1:
        raise ValueError(f"target must be in (0, 1], got {target!r}")
    tried: dict[int, dict[str, Any]] = {}

    def run(value: int) -> bool:
        if value not in tried:
            result = run_with(trace, config, latency, setting, value,
                              num_instances=num_instances, policy=policy)
            tried[value] = summarize(result, slo)
            if log is not None:
                log(f"  {setting}={value}: {tried[value]['goodput']['fraction']:.1%} meet the "
                    f"SLO ({result.wall_time:.1f} s)")
        return meets(tried[value], target)

    if setting == "instances":
        lo, hi = (low or 1), (high or 64)
        probe = lo
        while probe < hi and not run(probe):
            lo, probe = probe + 1, min(probe * 2, hi)
        hi = probe
    else:
        lo, hi = (low or 2), (high or config.num_blocks * 8)
    if not run(hi):
        return {"setting": setting, "value": None, "summary": tried[hi], "tried": tried}
    while lo < hi:  # invariant: hi meets the SLO
        mid = (lo + hi) // 2
        if setting == "num_blocks" and hi - lo <= max(1, hi // 100):
            break  # resolution: 1% of the answer is enough
        if run(mid):
            hi = mid
        else:
            lo = mid + 1
    return {"setting": setting, "value": hi, "summary": tried[hi], "tried": tried}
