"""Where does prefill/decode disaggregation start to pay? The simulator's answer for an H100
fleet at the Mooncake conversation trace's real lengths (the DistServe question).

For each request rate (the trace's own arrivals sped up by `--rates`), four instances run the
same requests as 4 mixed instances (kv-aware router) and as each split (2P+2D, 3P+1D, 1P+3D; the
prompt's KV crosses a `--kv-link-gbps` link, `pagedkv simulate --prefill-instances P
--decode-instances D`). Prints, per rate, every fleet's goodput (the fraction of requests meeting
`--slo`) with its TTFT and TPOT p99, and the loosest TPOT target (the SLO's TTFT kept) under which
the best split beats mixing; then the crossover: the rates at which the winner changes, and
which SLO target each side misses there (what holds it back); then each fleet's capacity (the
highest rate at which it keeps `--target` goodput). Simulator only: no model runs; under a
minute at the defaults.

    python benchmarks/bench_pd_crossover.py [--requests 300] [--rates 0.5,1,1.5,2,3]
        [--slo ttft=5,tpot=0.05] [--scale-lengths 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pagedkv.bench.datasets import shared_trace  # noqa: E402  (after the path)
from pagedkv.commands.simulate import add_parser  # noqa: E402
from pagedkv.sim.disagg import Split, simulate_split  # noqa: E402
from pagedkv.sim.latency import make_latency_model  # noqa: E402
from pagedkv.sim.results import SLO, summarize  # noqa: E402
from pagedkv.sim.setup import build_sim_config  # noqa: E402
from pagedkv.sim.simulator import SimResult, simulate  # noqa: E402
from pagedkv.sim.traces import load_trace  # noqa: E402

TRACE = shared_trace("mooncake_conversation_trace.jsonl")
TPOT_TARGETS_S = [t / 1000 for t in (10, 15, 20, 25, 30, 40, 50, 60, 80, 100, 150, 200)]
SHAPES: list[tuple[int, int] | int] = [4, (2, 2), (3, 1), (1, 3)]  # N: N mixed instances


def sim_args(argv: list[str]) -> argparse.Namespace:
    """`pagedkv simulate`'s flags and defaults (the same engine as the CLI simulates)."""
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers()).set_defaults()
    return parser.parse_args(["simulate", *argv])


def shape_name(shape: tuple[int, int] | int) -> str:
    return f"{shape[0]}P+{shape[1]}D" if isinstance(shape, tuple) else f"{shape} mixed"


def run_shape(shape: tuple[int, int] | int, trace: list, config: Any, latency: Any,
              link_gbps: float) -> SimResult:
    """One fleet over `trace`: N mixed instances behind the kv-aware router, or a P:D split."""
    if isinstance(shape, tuple):
        return simulate_split(trace, config, latency, Split(*shape, link_gbps))
    return simulate(trace, config, latency, num_instances=shape, policy="kv-aware")


def figures(shape: tuple[int, int] | int, result: SimResult, slo: SLO) -> dict[str, Any]:
    """A fleet's goodput under `slo`, TTFT/TPOT p50 and p99 (s), transfer mean (s, splits)."""
    summary = summarize(result, slo)
    lat = summary["latency"]
    return {"fleet": shape_name(shape), "goodput": summary["goodput"]["fraction"],
            "ttft_p50": lat["ttft"]["p50"], "ttft_p99": lat["ttft"]["p99"],
            "tpot_p50": lat["tpot"]["p50"], "tpot_p99": lat["tpot"]["p99"],
            "xfer_mean": result.extra.get("split", {}).get("transfer_seconds_mean")}


def goodput(result: SimResult, slo: SLO) -> float:
    return summarize(result, slo)["goodput"]["fraction"]


def best_split(fleets: list[dict[str, Any]]) -> dict[str, Any]:
    return max(fleets[1:], key=lambda f: f["goodput"])


def winner(row: dict[str, Any]) -> str:
    """"split" when the best split's goodput beats the mixed fleet's, else "mixed"."""
    return "split" if best_split(row["fleets"])["goodput"] > row["fleets"][0]["goodput"] \
        else "mixed"


def rate_crossovers(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each rate at which the winner changes from the rate before (in either direction)."""
    return [{"rate_x": row["rate_x"], "requests_per_s": row["requests_per_s"],
             "winner": winner(row), "split": best_split(row["fleets"]),
             "mixed": row["fleets"][0]}
            for before, row in itertools.pairwise(table) if winner(before) != winner(row)]


def tpot_crossover(results: list[SimResult], slo: SLO) -> float | None:
    """The loosest TPOT target (TTFT's kept) at which the best split's goodput beats the
    mixed fleet's (`results[0]`); None when no target in TPOT_TARGETS_S gives one."""
    wins = [t for t in TPOT_TARGETS_S
            if max(goodput(r, dataclasses.replace(slo, tpot=t)) for r in results[1:])
            > goodput(results[0], dataclasses.replace(slo, tpot=t))]
    return max(wins) if wins else None


def misses(fleet: dict[str, Any], slo: SLO) -> str:
    """Which of the SLO's targets the fleet's p99 misses (what holds it back)."""
    out = [f"{name} p99 {fleet[name + '_p99'] * scale:.1f}{unit} > {target * scale:g}{unit}"
           for name, target, scale, unit in (("ttft", slo.ttft, 1, "s"), ("tpot", slo.tpot,
                                                                          1e3, "ms"))
           if target is not None and fleet[name + "_p99"] > target]
    return ", ".join(out) or "none at p99"


def print_row(row: dict[str, Any]) -> None:
    cells = " | ".join(f"{f['fleet']:>7} {f['goodput']:6.1%} ttft99 {f['ttft_p99']:6.2f}s "
                       f"tpot99 {f['tpot_p99'] * 1e3:5.1f}ms" for f in row["fleets"])
    tpot = row["tpot_crossover_s"]
    where = "never" if tpot is None else f"tpot <= {tpot * 1e3:g}ms"
    print(f"x{row['rate_x']:<5g} {row['requests_per_s']:6.2f} req/s | {cells} | split wins: "
          f"{where}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--requests", type=int, default=300, help="the trace's first N requests")
    p.add_argument("--rates", default="0.5,1,1.5,2,3",
                   help="request-rate multipliers of the trace's own arrivals")
    p.add_argument("--slo", default="ttft=5,tpot=0.05")
    p.add_argument("--scale-lengths", type=float, default=1.0)
    p.add_argument("--hardware", default="h100")
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--kv-link-gbps", type=float, default=100.0)
    p.add_argument("--target", type=float, default=0.9,
                   help="goodput a fleet must keep to count as serving a rate")
    p.add_argument("--json", default=None)
    opts = p.parse_args()
    rates = [float(r) for r in opts.rates.split(",")]
    if not rates or min(rates) <= 0:
        p.error(f"--rates must be positive multipliers, got {opts.rates!r}")
    slo = SLO.parse(opts.slo)
    args = sim_args([opts.trace, "--hardware", opts.hardware, "--model", opts.model])
    config, model_config, hardware = build_sim_config(args)
    latency = make_latency_model(f"roofline:{hardware}", model_config)
    started = time.perf_counter()
    table = []
    print(f"{opts.requests} requests of {Path(opts.trace).name} (lengths x{opts.scale_lengths:g})"
          f", {opts.model} on {opts.hardware}, 4 instances, SLO {opts.slo}, KV link "
          f"{opts.kv_link_gbps:g} Gb/s; goodput = fraction of requests meeting the SLO")
    for rate in rates:
        trace = load_trace(opts.trace, "mooncake", scale_lengths=opts.scale_lengths,
                           time_scale=1 / rate, limit=opts.requests)
        results = [run_shape(s, trace, config, latency, opts.kv_link_gbps) for s in SHAPES]
        row = {"rate_x": rate, "requests_per_s": len(trace) / max(trace[-1].arrival, 1e-9),
               "fleets": [figures(s, r, slo) for s, r in zip(SHAPES, results, strict=True)],
               "tpot_crossover_s": tpot_crossover(results, slo)}
        table.append(row)
        print_row(row)
    changes = rate_crossovers(table)
    first = table[0]
    print(f"x{first['rate_x']:g}: {winner(first)} wins "
          f"(best split {best_split(first['fleets'])['fleet']} misses "
          f"{misses(best_split(first['fleets']), slo)}; mixed misses "
          f"{misses(first['fleets'][0], slo)})")
    for change in changes:
        print(f"crossover at x{change['rate_x']:g} ({change['requests_per_s']:.2f} req/s): "
              f"{change['winner']} wins from here: best split {change['split']['fleet']} "
              f"{change['split']['goodput']:.1%} (misses {misses(change['split'], slo)}) vs "
              f"4 mixed {change['mixed']['goodput']:.1%} (misses "
              f"{misses(change['mixed'], slo)})")
    if not changes:
        print(f"no crossover in x{rates[0]:g}..x{rates[-1]:g}: {winner(first)} wins at every "
              "rate")
    for f in table[0]["fleets"]:
        capacity = [row["rate_x"] for row in table
                    if next(g for g in row["fleets"] if g["fleet"] == f["fleet"])["goodput"]
                    >= opts.target]
        print(f"{f['fleet']:>8}: highest rate with goodput >= {opts.target:.0%}: "
              f"{'none' if not capacity else 'x' + format(max(capacity), 'g')}")
    print(f"({time.perf_counter() - started:.1f} s wall)")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"table": table, "crossovers": changes,
                                               "slo": opts.slo, "options": vars(opts)},
                                              indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
