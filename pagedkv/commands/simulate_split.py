"""`pagedkv simulate`'s prefill/decode split (pagedkv/sim/disagg.py): its flags and runs.

    pagedkv simulate TRACE --prefill-instances P --decode-instances D [--kv-link-gbps G]
        [--decode-latency MODEL] [--compare-mixed] [--slo ttft=2,tpot=0.1]
    pagedkv simulate TRACE --sweep split=1:3,2:2,3:1,4 --slo ...   (P:D splits; N: N mixed)
    pagedkv simulate TRACE --search split --slo ... [--split-max-instances 16]

A split run prints the usual table for the split fleet (TTFT from the client's arrival to the
decode instance's first token, prefill and transfer included) and the transfers' figures;
`--compare-mixed` adds the same trace on P + D mixed instances behind `--policy`. A split sweep
prints one row per fleet shape, so an operator can read, for a trace and an SLO, how many of
each pays and whether splitting beats mixing the same number of instances; `--search split`
finds the smallest split fleet meeting the SLO (every P + D = N for N = 2, 3, ...) and the
fewest mixed instances meeting it. `--decode-latency` gives the decode instances their own
step cost (`--latency`'s forms: a fitted JSON, roofline:HARDWARE): decode instances on other
hardware than the prefill ones, or a model fitted on a real decode instance's steps.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

DEFAULT_LINK_GBPS = 100.0
SPLIT_SWEEP = "split="


def add_split_flags(group: Any) -> None:
    """Register the split's flags on an argparse group."""
    group.add_argument("--prefill-instances", type=int, default=None, metavar="P",
                       help="prefill/decode split: P prefill instances (with "
                       "--decode-instances; --policy places prefills)")
    group.add_argument("--decode-instances", type=int, default=None, metavar="D",
                       help="prefill/decode split: D decode instances (placed by load and "
                       "KV room)")
    group.add_argument("--kv-link-gbps", type=float, default=DEFAULT_LINK_GBPS, metavar="G",
                       help="each prefill instance's link to the decode instances, in "
                       "gigabits/s (inf: instant); a prompt's KV bytes cross it")
    group.add_argument("--decode-latency", default=None, metavar="MODEL",
                       help="the decode instances' step cost, as --latency (default: "
                       "--latency's)")
    group.add_argument("--compare-mixed", action="store_true",
                       help="with the split: also run P + D mixed instances")
    group.add_argument("--split-max-instances", type=int, default=16, metavar="N",
                       help="--search split tries fleets of up to N instances in all")


def wants_split(args: argparse.Namespace) -> bool:
    """Whether the flags ask for a split run or sweep; ValueError naming a flag that is
    missing or out of range (before any work)."""
    sweep = (args.sweep or "").replace("-", "_").startswith(SPLIT_SWEEP)
    search = args.search == "split"
    given = args.prefill_instances is not None or args.decode_instances is not None
    if given and (args.prefill_instances is None or args.decode_instances is None):
        raise ValueError("the prefill/decode split needs --prefill-instances and "
                         "--decode-instances together")
    if not args.kv_link_gbps > 0:
        raise ValueError(f"--kv-link-gbps must be > 0 (inf for an instant link), got "
                         f"{args.kv_link_gbps}")
    if args.split_max_instances < 2:
        raise ValueError(f"--split-max-instances must be >= 2, got {args.split_max_instances}")
    if not (given or sweep or search):
        for flag in ("compare_mixed", "decode_latency"):
            if getattr(args, flag):
                raise ValueError(f"--{flag.replace('_', '-')} needs --prefill-instances and "
                                 "--decode-instances")
        return False
    for flag, value in (("--prefill-instances", args.prefill_instances),
                        ("--decode-instances", args.decode_instances)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.search and not search:
        raise ValueError(f"--search {args.search} is not available with the prefill/decode "
                         "split (--search split is)")
    if search and (given or args.sweep):
        raise ValueError("--search split finds the split itself: not with "
                         "--prefill-instances/--decode-instances or --sweep")
    for flag in ("event_log", "plot"):
        if getattr(args, flag):
            raise ValueError(f"--{flag.replace('_', '-')} is not available with the "
                             "prefill/decode split")
    if given and args.sweep and not sweep:
        raise ValueError("with the split, --sweep takes split=P:D,...")
    return True


def parse_split_sweep(text: str) -> list[tuple[int, int] | int]:
    """'split=1:3,2:2,4' -> [(1, 3), (2, 2), 4] (P:D splits, N mixed instances)."""
    shapes: list[tuple[int, int] | int] = []
    for item in text.partition("=")[2].split(","):
        p, colon, d = item.strip().partition(":")
        try:
            shape = (int(p), int(d)) if colon else int(p)
        except ValueError:
            raise ValueError(f"bad --sweep {text!r}: expected split=P:D,... (or N for N mixed "
                             "instances)") from None
        if min(shape if isinstance(shape, tuple) else (shape,)) < 1:
            raise ValueError(f"bad --sweep {text!r}: instance counts must be >= 1")
        shapes.append(shape)
    return shapes


def run_split(args: argparse.Namespace, trace: Any, config: Any, latency: Any, slo: Any,
              decode_latency: Any = None) -> int:
    """Run what `wants_split` saw asked for and print it (`decode_latency`: the decode
    instances' model, default `latency`)."""
    from pagedkv.sim.results import format_table, write_json

    if decode_latency is not None:
        latency = (latency, decode_latency)

    if args.search:
        return _search(args, trace, config, latency, slo)
    if args.sweep:
        rows = [_run_shape(s, args, trace, config, latency, slo)
                for s in parse_split_sweep(args.sweep)]
        print(f"{'fleet':>16} {'ttft p50':>9} {'ttft p99':>9} {'tpot p50':>9} {'tpot p99':>9} "
              f"{'e2e p99':>9} {'xfer mean':>9} {'goodput':>8}  (ms)")
        for row in rows:
            print(_row_line(row))
        if args.json:
            write_json({"sweep": rows}, args.json)
        return 0
    shape = (args.prefill_instances, args.decode_instances)
    out = {"split": _run_shape(shape, args, trace, config, latency, slo)}
    if args.compare_mixed:
        out["mixed"] = _run_shape(sum(shape), args, trace, config, latency, slo)
    for name, summary in out.items():
        print(f"{name}: {summary['fleet']}")
        print(format_table(summary))
        if "split" in summary:
            s = summary["split"]
            print(f"transfers {s['transfers']}: {s['transfer_bytes'] / 1e9:.3f} GB over "
                  f"{args.kv_link_gbps:g} Gb/s links, {s['transfer_seconds_mean'] * 1e3:.2f} ms "
                  f"mean, {s['transfer_seconds_max'] * 1e3:.2f} ms max (link queue included)")
    if args.json:
        write_json(out, args.json)
    return 0


def _search(args: argparse.Namespace, trace: Any, config: Any, latency: Any, slo: Any) -> int:
    """--search split: the smallest split fleet meeting the SLO, beside the fewest mixed
    instances (the same search over `instances`) for the comparison."""
    import sys

    from pagedkv.sim.disagg import split_search
    from pagedkv.sim.results import format_table, write_json
    from pagedkv.sim.search import capacity_search

    def log(message: str) -> None:
        print(message, file=sys.stderr)

    prefill, decode = latency if isinstance(latency, tuple) else (latency, None)
    found = split_search(trace, config, prefill, slo, link_gbps=args.kv_link_gbps,
                         target=args.target, max_instances=args.split_max_instances,
                         policy=args.policy, log=log, decode_latency=decode)
    mixed = capacity_search(trace, config, prefill, slo, setting="instances",
                            target=args.target, high=args.split_max_instances,
                            policy=args.policy, log=log)
    meeting = f"meeting {args.slo} for {args.target:.0%} of requests"
    if found["value"] is None:
        print(f"no split of up to {args.split_max_instances} instances {meeting}")
    else:
        p, d = found["value"]
        print(f"smallest split {meeting}: {p} prefill + {d} decode ({p + d} instances)")
        print(format_table(found["summary"]))
    print(f"fewest mixed instances {meeting}: "
          f"{'none up to the bound' if mixed['value'] is None else mixed['value']}")
    if args.json:
        write_json({"split": {"value": found["value"], "summary": found["summary"],
                              "tried": found["tried"]},
                    "mixed": {"value": mixed["value"], "summary": mixed["summary"],
                              "tried": {str(k): v for k, v in mixed["tried"].items()}}},
                   args.json)
    return 0


def _run_shape(shape: tuple[int, int] | int, args: argparse.Namespace, trace: Any,
               config: Any, latency: Any, slo: Any) -> dict[str, Any]:
    """One run: a P:D split, or N mixed instances; its summary with `fleet` naming it.
    `latency`: one model, or (prefill's, decode's) for a split (mixed ones take the first)."""
    from pagedkv.sim.disagg import Split, simulate_split
    from pagedkv.sim.results import summarize
    from pagedkv.sim.simulator import simulate

    latency, decode = latency if isinstance(latency, tuple) else (latency, None)
    if isinstance(shape, tuple):
        result = simulate_split(trace, config, latency, Split(*shape, args.kv_link_gbps),
                                policy=args.policy, decode_latency=decode)
        summary = summarize(result, slo)
        summary["split"] = result.extra["split"]
        summary["fleet"] = f"{shape[0]} prefill + {shape[1]} decode instances"
    else:
        result = simulate(trace, config, latency, num_instances=shape, policy=args.policy)
        summary = summarize(result, slo)
        summary["fleet"] = f"{shape} instances"
    return summary


def _row_line(row: dict[str, Any]) -> str:
    lat = row["latency"]
    xfer = row.get("split", {}).get("transfer_seconds_mean")
    good = row["goodput"]["fraction"] if "goodput" in row else None
    fleet = row["fleet"].replace(" prefill + ", "P+").replace(" decode instances", "D")
    cells = [lat["ttft"]["p50"], lat["ttft"]["p99"], lat["tpot"]["p50"], lat["tpot"]["p99"],
             lat["e2e"]["p99"]]
    return (f"{fleet.replace(' instances', ' mixed'):>16} "
            + " ".join(f"{v * 1e3:>9.1f}" if math.isfinite(v) else f"{'-':>9}" for v in cells)
            + f" {'-' if xfer is None else format(xfer * 1e3, '.2f'):>9}"
            + f" {'-' if good is None else format(good, '.1%'):>8}")
