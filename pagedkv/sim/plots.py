"""The simulator's PNGs (`pagedkv simulate --plot PATH`, matplotlib, Agg backend).

One run: a title naming the trace, model, hardware and instances; KV usage over time; running
and queued requests over time (all instances together); each request's TTFT and E2E by arrival,
with the SLO's lines. A sweep (`--sweep`) or a capacity search (`--search`): each metric against
the setting's values (goodput with the target, TTFT and E2E percentiles with the SLO, the prefix
hit rate), the search's answer marked.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pagedkv.bench.plot import _pyplot
from pagedkv.sim.results import SLO
from pagedkv.sim.simulator import SimResult

MAX_POINTS = 4000  # samples per line: a million steps plot as fast as a thousand


@dataclass(frozen=True)
class PlotTitle:
    """What a plot says it shows."""

    trace: str
    model: str
    hardware: str
    instances: int | None = 1  # None: the count varies (a sweep or search over instances)
    policy: str | None = None

    def text(self, detail: str = "") -> str:
        first = f"{self.trace}: {self.model} on {self.hardware}"
        if self.instances is not None:
            first += f", {self.instances} instance{'s' if self.instances != 1 else ''}"
            if self.instances > 1 and self.policy:
                first += f" ({self.policy})"
        elif self.policy:
            first += f", {self.policy} routing"
        return f"{first}\n{detail}" if detail else first


def _thin(values: Sequence[float]) -> list[float]:
    return list(values)[::max(1, len(values) // MAX_POINTS)]


def _queues(result: SimResult) -> tuple[list[float], list[int], list[int]]:
    """(times, running, queued) summed over the instances, on the union of their sample
    times (each instance's count holds until its next sample)."""
    series = [(list(i.stats.usage_times), list(i.stats.running_values),
               list(i.stats.waiting_values)) for i in result.instances]
    times = _thin(sorted({t for ts, _, _ in series for t in ts}))
    running, queued = [0] * len(times), [0] * len(times)
    for ts, run, wait in series:
        for k, t in enumerate(times):
            j = bisect.bisect_right(ts, t) - 1
            if j >= 0:
                running[k] += run[j]
                queued[k] += wait[j]
    return times, running, queued


def _slo_line(ax: Any, value: float | None, metric: str, color: str) -> None:
    """The SLO's target on `metric` as a dashed line labelled "METRIC SLO 2 s"."""
    if value is not None:
        ax.axhline(value, color=color, ls="--", lw=1, label=f"{metric} SLO {value:g} s")


def _save(fig: Any, path: str | Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)


def plot_run(result: SimResult, path: str | Path, title: PlotTitle,
             slo: SLO | None = None) -> None:
    """One run's PNG (see the module docstring) at `path`."""
    _save(run_figure(result, title, slo), path)


def plot_sweep(rows: Sequence[dict[str, Any]], setting: str, path: str | Path,
               title: PlotTitle, slo: SLO | None = None, **marks: Any) -> None:
    """A sweep's or a search's PNG at `path` (`sweep_figure`)."""
    _save(sweep_figure(rows, setting, title, slo, **marks), path)


def run_figure(result: SimResult, title: PlotTitle, slo: SLO | None = None) -> Any:
    """One run's figure: usage, queues, latencies over time (the module docstring)."""
    plt = _pyplot()
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    done = [r for r in result.records if r.finish is not None and r.ttft is not None]
    fig.suptitle(title.text(f"{len(result.records)} requests, {len(done)} finished; latency: "
                            f"{result.latency_name}"), fontsize=10)
    for inst in result.instances:
        ax1.plot(_thin(inst.stats.usage_times), [v * 100 for v in _thin(inst.stats.usage_values)],
                 lw=0.8, label=f"instance {inst.index}")
    ax1.set_ylabel("KV usage (%)")
    ax1.set_ylim(0, 105)
    if len(result.instances) > 1:
        ax1.legend(loc="upper right", fontsize="small")
    times, running, queued = _queues(result)
    ax2.step(times, running, where="post", lw=0.8, label="running")
    ax2.step(times, queued, where="post", lw=0.8, label="queued (waiting, swapped, loading)")
    ax2.set_ylabel("requests")
    ax2.legend(loc="upper right", fontsize="small")
    arrivals = [r.arrival for r in done]
    ax3.scatter(arrivals, [r.ttft for r in done], s=2, color="C0", label="TTFT")
    ax3.scatter(arrivals, [r.e2e for r in done], s=2, color="C1", label="E2E")
    slo = slo or SLO()
    if slo.tpot is not None:
        with_tpot = [r for r in done if r.tpot is not None]
        ax3.scatter([r.arrival for r in with_tpot], [r.tpot for r in with_tpot], s=2,
                    color="C2", label="TPOT")
    for metric, color in (("ttft", "C0"), ("e2e", "C1"), ("tpot", "C2")):
        _slo_line(ax3, getattr(slo, metric), metric.upper(), color)
    if done:
        ax3.set_yscale("log")
    ax3.set_ylabel("seconds (by arrival)")
    ax3.set_xlabel("virtual time (s)")
    ax3.legend(loc="upper left", fontsize="small")
    return fig


def sweep_figure(rows: Sequence[dict[str, Any]], setting: str, title: PlotTitle,
                 slo: SLO | None = None, *, target: float | None = None, answer: Any = None,
                 searched: bool = False) -> Any:
    """Each metric of `rows` (summaries, each with its `value` of `setting`) against the
    values: goodput (with an SLO; with `target`, when given), TTFT and E2E p50/p99 (with the
    SLO's lines), the device prefix hit rate. A search's `answer` is marked (`searched`: None
    means no value met the SLO)."""
    plt = _pyplot()
    rows = sorted(rows, key=lambda r: (isinstance(r["value"], str), r["value"]))
    numeric = all(isinstance(r["value"], (int, float)) for r in rows)
    xs = [r["value"] for r in rows] if numeric else list(range(len(rows)))
    with_goodput = slo is not None and all("goodput" in r for r in rows)
    fig, axes = plt.subplots(1, 3 if with_goodput else 2, figsize=(13 if with_goodput else 9, 4))
    if setting == "instances":  # the title's fixed count is what varies here
        title = replace(title, instances=None)
    what = f"{len(rows)} run{'s' if len(rows) != 1 else ''} over {setting}"
    if searched:
        what += (f"; fewest meeting the SLO: {answer}" if answer is not None
                 else "; none up to the search bound meets the SLO")
    fig.suptitle(title.text(what), fontsize=10)
    latency_ax, hits_ax = axes[-2], axes[-1]
    if with_goodput:
        axes[0].plot(xs, [r["goodput"]["fraction"] * 100 for r in rows], marker="o",
                     label="meeting the SLO")
        if target is not None:
            axes[0].axhline(target * 100, color="C3", ls="--", lw=1, label=f"target {target:.0%}")
        axes[0].set_ylabel("goodput (% of requests)")
        axes[0].set_ylim(0, 105)
    for metric, color in (("ttft", "C0"), ("e2e", "C1")):
        for q, style in (("p50", "-"), ("p99", ":")):
            latency_ax.plot(xs, [r["latency"][metric][q] for r in rows], style, marker="o",
                            color=color, label=f"{metric.upper()} {q}")
        _slo_line(latency_ax, getattr(slo, metric, None), metric.upper(), color)
    latency_ax.set_ylabel("seconds")
    latency_ax.set_ylim(bottom=0)
    hits_ax.plot(xs, [r["prefix_cache"]["device"]["hit_rate"] * 100 for r in rows],
                 marker="o", label="device prefix hits")
    hits_ax.set_ylabel("prefix hit rate (% of prompt tokens)")
    hits_ax.set_ylim(0, 105)
    for ax in axes:
        ax.set_xlabel(setting)
        if not numeric:
            ax.set_xticks(xs, [str(r["value"]) for r in rows])
        elif all(isinstance(x, int) for x in xs):  # the settings run, never 1.5 instances
            ax.set_xticks(xs, [str(x) for x in xs])
        if answer is not None and numeric:
            ax.axvline(answer, color="C2", lw=1)
        ax.legend(fontsize="small")
    return fig
