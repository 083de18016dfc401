"""Serving benchmark metrics with the definitions of vLLM's `benchmark_serving`.

Per request: TTFT = first streamed chunk - send time; ITL = gaps between later chunks;
E2E latency = last chunk - send time; TPOT = (E2E - TTFT) / (output tokens - 1), only for
requests with more than one output token. Throughputs divide by the whole run's wall time.
Percentiles interpolate linearly (numpy's default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class RequestResult:
    """What the client saw of one request (seconds, from `time.perf_counter`)."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    error: str = ""
    response_id: str = ""  # the response's `id` (joins the server's request log)
    sent: float = 0.0  # when it was sent (time.perf_counter)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def _summary(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """mean / median / p99 of `values`, times `scale` (seconds -> ms by default)."""
    mean = sum(values) / len(values) if values else 0.0
    return {"mean": mean * scale, "median": percentile(values, 50) * scale,
            "p99": percentile(values, 99) * scale}


def compute_metrics(results: list[RequestResult], duration: float,
                    prefix_cache: tuple[float, float] | None = None) -> dict:
    """The benchmark's figures. `prefix_cache` is the server's (hits, queries) delta over the
    run, when known. Times in ms, throughputs per second."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    duration = max(duration, 1e-9)
    hits, queries = prefix_cache if prefix_cache else (0.0, 0.0)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "ttft_ms": _summary([r.ttft for r in ok]),
        "tpot_ms": _summary(tpots),
        "itl_ms": _summary([x for r in ok for x in r.itl]),
        "e2el_ms": _summary([r.latency for r in ok]),
        "prefix_cache_hits": hits,
        "prefix_cache_queries": queries,
        "prefix_cache_hit_rate": hits / queries if queries else None,
        "client_cached_tokens": sum(r.cached_tokens for r in ok),
        "errors": sorted({r.error for r in results if not r.success})[:5],
    }


def format_table(metrics: dict, title: str = "Serving Benchmark Result") -> str:
    """vLLM-style text table of `compute_metrics`' figures."""
    lines = [f"{title:=^60}"]

    def row(label: str, value: object, fmt: str = "{:<40} {:>19}") -> None:
        lines.append(fmt.format(label, value))

    row("Successful requests:", metrics["completed"])
    row("Failed requests:", metrics["failed"])
    row("Benchmark duration (s):", f"{metrics['duration_s']:.2f}")
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total generated tokens:", metrics["total_output_tokens"])
    row("Request throughput (req/s):", f"{metrics['request_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{metrics['output_throughput']:.2f}")
    row("Total token throughput (tok/s):", f"{metrics['total_token_throughput']:.2f}")
    rate = metrics["prefix_cache_hit_rate"]
    row("Prefix cache hit rate:", "n/a" if rate is None else f"{100 * rate:.2f}%")
    for key, name in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token "
                      "(excl. 1st token)"), ("itl_ms", "Inter-token Latency"),
                      ("e2el_ms", "End-to-end Latency")):
        lines.append(f"{name:-^60}")
        short = key.split("_")[0].upper()
        for stat in ("mean", "median", "p99"):
            label = {"mean": "Mean", "median": "Median", "p99": "P99"}[stat]
            row(f"{label} {short} (ms):", f"{metrics[key][stat]:.2f}")
    lines.append("=" * 60)
    for error in metrics["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)
