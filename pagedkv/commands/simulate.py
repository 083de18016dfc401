"""`pagedkv simulate TRACE`: replay a request trace through pagedkv's real scheduler and KV
cache manager on a virtual clock, with a latency model instead of the model runner.

    pagedkv simulate TRACE [--trace-format mooncake|azure|request-log] [--limit N]
        [--scale-lengths F] [--time-scale F] [--model CONFIG] [--hardware h100]
        [--latency roofline:h100 | PROFILE.json | linear] [engine flags: --block-size,
        --kv-cache-dtype, --num-gpu-blocks-override, --max-num-seqs, --preemption-mode, ...]
        [--instances N --policy kv-aware|round-robin|least-load|session]
        [--data-parallel-size N]
        [--slo ttft=2,tpot=0.1] [--sweep SETTING=V1,V2] [--search num_blocks|instances]
        [--prefill-instances P --decode-instances D --kv-link-gbps G [--compare-mixed]]
        [--json OUT.json] [--plot OUT.png]

The KV cache holds `--num-gpu-blocks-override` blocks, else `--kv-cache-memory-bytes`, else
what `pagedkv plan` gives for `--model` on `--hardware`'s memory. Needs no torch and no weights.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from pagedkv.commands.engine_flags import HelpFormatter, add_option_flags, positive_number
from pagedkv.commands.simulate_split import add_split_flags, run_split, wants_split
from pagedkv.config.options import CacheOptions, ModelOptions, SchedulerOptions, StoreOptions
from pagedkv.router.policies import POLICY_NAMES

if TYPE_CHECKING:
    from pagedkv.sim.plots import PlotTitle

DEFAULT_MODEL = "qwen3-8b"
DEFAULT_HARDWARE = "h100"


# The engine options the simulator models (pagedkv.sim.setup reads them), with their declared
# defaults but the block hash's.
SIMULATED_OPTIONS = (
    "gpu_memory_utilization", "block_size", "kv_cache_dtype", "num_gpu_blocks_override",
    "kv_cache_memory_bytes", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
    "preemption_mode", "swap_space", "scheduling_policy", "long_prefill_token_threshold",
    "prefill_batching", "prefill_step_overhead_tokens", "prefill_decode_overhead_tokens",
    "watermark", "enable_prefix_caching",
    "prefix_caching_hash_algo", "eviction_policy", "kv_offloading_size",
    "kv_offloading_disk_path", "kv_offloading_disk_size", "kv_offloading_remote_url")
_SIMULATED_HELP = {
    "prefix_caching_hash_algo": "block hash; any injective hash makes the same decisions, and "
                                "xxhash is the faster one to simulate with",
    "kv_offloading_disk_path": "simulate the KV store's disk tier (nothing is written here)",
    "kv_offloading_remote_url": "simulate the KV store's Redis tier (nothing is contacted)",
}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `simulate` subcommand on an argparse subparsers object."""
    p = subparsers.add_parser("simulate", help="replay a trace through the real scheduler on "
                              "a virtual clock", description=__doc__.split("\n\n")[0],
                              formatter_class=HelpFormatter)
    p.add_argument("trace", metavar="TRACE", help="Mooncake JSONL, Azure CSV or a pagedkv "
                   "request log (serve --request-log)")
    p.add_argument("--trace-format", choices=("mooncake", "azure", "request-log"), default=None,
                   help="trace format (default: sniffed from the file)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="first N requests only")
    p.add_argument("--start", type=int, default=0, metavar="I", help="skip the first I requests")
    p.add_argument("--scale-lengths", type=positive_number, default=1.0, metavar="F",
                   help="multiply input and output lengths (and prefix blocks) by F")
    p.add_argument("--time-scale", type=positive_number, default=1.0, metavar="F",
                   help="multiply arrival times by F (0.5 = twice the request rate)")
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="CONFIG",
                   help="model config: a config.json, a model directory or a bundled name "
                   "(sizes the KV cache and the roofline)")
    p.add_argument("--hardware", default=DEFAULT_HARDWARE,
                   help="h100, a100, cpu (measured now) or a JSON file: memory for the KV "
                   "cache size and ceilings for the roofline")
    p.add_argument("--latency", default=None, metavar="MODEL",
                   help="a JSON file from `pagedkv profile` (with the serving frontend's "
                   "delays when fitted with --request-log), roofline:HARDWARE or linear "
                   "(default: roofline on --hardware)")
    e = add_option_flags(
        p, CacheOptions, SchedulerOptions, ModelOptions, StoreOptions, only=SIMULATED_OPTIONS,
        defaults={"prefix_caching_hash_algo": "xxhash"}, helps=_SIMULATED_HELP,
        title="engine", description="the simulated engine (vLLM's names)")
    e.add_argument("--kv-offloading-remote-size", type=float, default=None, metavar="GIB",
                   help="the Redis tier's memory (default: unbounded, as Redis's maxmemory "
                   "is set outside pagedkv)")
    e.add_argument("--tier-speeds", default=None, metavar="TIER=BYTES/S[:LATENCY_S],...",
                   help="the store tiers' read speeds (default: host=10e9:2e-05,"
                   "disk=2e9:0.0002,redis=1e9:0.0005)")
    e.add_argument("--no-jump", dest="jump", action="store_false",
                   help="step one by one (no quiet-stretch jumps; same results, slower)")
    c = p.add_argument_group("cluster and results")
    c.add_argument("--instances", type=int, default=1, metavar="N")
    c.add_argument("--policy", choices=POLICY_NAMES, default="kv-aware",
                   help="routing policy with --instances > 1")
    c.add_argument("--data-parallel-size", type=int, default=None, metavar="N",
                   help="N engine cores of one `pagedkv serve --data-parallel-size N`, placed "
                   "by its front end (kv-aware, on its own books); not with --instances")
    c.add_argument("--slo", default=None, help="e.g. ttft=2,tpot=0.1 (seconds, or 200ms)")
    c.add_argument("--sweep", default=None, metavar="SETTING=V1,V2",
                   help="one run per value, e.g. num_blocks=2000,4000 or instances=1,2,4")
    c.add_argument("--search", choices=("num_blocks", "instances", "split"), default=None,
                   help="with --slo: the fewest blocks or instances meeting it (split: the "
                   "smallest prefill/decode fleet, beside the fewest mixed instances)")
    c.add_argument("--target", type=float, default=0.99,
                   help="fraction of requests that must meet the SLO in --search")
    c.add_argument("--json", default=None, metavar="PATH", help="write the summary as JSON")
    c.add_argument("--event-log", default=None, metavar="PATH",
                   help="write instance 0's block feed as a dashboard log (JSON) to replay in "
                        "/dashboard ('replay log'), beside a live run")
    c.add_argument("--plot", default=None, metavar="PATH",
                   help="write a PNG: KV usage, running and queued requests and latencies over "
                        "time; with --sweep or --search, each metric against the setting")
    add_split_flags(p.add_argument_group(
        "prefill/decode split", "prefill and decode on separate instances, the prompt's KV "
        "sent between them (sweep the split with --sweep split=P:D,...,N)"))
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from pagedkv.sim.latency import make_latency_model
    from pagedkv.sim.results import SLO, format_table, summarize, write_json
    from pagedkv.sim.search import capacity_search, parse_sweep, sweep
    from pagedkv.sim.setup import build_sim_config
    from pagedkv.sim.simulator import simulate
    from pagedkv.sim.traces import load_trace

    if args.instances < 1:
        raise ValueError(f"--instances must be >= 1, got {args.instances}")
    split = wants_split(args)
    data_parallel = args.data_parallel_size is not None
    if data_parallel:
        if args.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
        if args.instances > 1:
            raise ValueError("--data-parallel-size N is one server of N cores; --instances is "
                             "N servers behind a router: give one")
        if args.search or args.sweep:
            raise ValueError("--data-parallel-size runs once: not with --search or --sweep")
        if split:
            raise ValueError("--data-parallel-size is one server of mixed cores: not with "
                             "--prefill-instances/--decode-instances")
        args.instances = args.data_parallel_size
    slo = SLO.parse(args.slo)
    if args.search and slo is None:
        raise ValueError("--search needs --slo")
    if args.search and args.sweep:
        raise ValueError("--search and --sweep are two kinds of run: give one")
    if args.event_log and (args.search or args.sweep):
        raise ValueError("--event-log records one run: not with --search or --sweep")
    trace = load_trace(args.trace, args.trace_format, scale_lengths=args.scale_lengths,
                       time_scale=args.time_scale, limit=args.limit, start=args.start)
    if not trace:
        raise ValueError(f"trace {args.trace!r} has no requests")
    config, model_config, hardware = build_sim_config(args)
    latency = make_latency_model(args.latency or f"roofline:{hardware}", model_config,
                                 kv_cache_dtype=args.kv_cache_dtype)
    print(f"trace: {len(trace)} requests over {trace[-1].arrival:.1f} s; KV cache "
          f"{config.num_blocks - 1} blocks of {config.block_size} tokens; max_model_len "
          f"{config.max_model_len}; latency: {latency.name}", file=sys.stderr)
    if split:
        decode = None if args.decode_latency is None else make_latency_model(
            args.decode_latency, model_config, kv_cache_dtype=args.kv_cache_dtype)
        return run_split(args, trace, config, latency, slo, decode)
    if args.search:
        found = capacity_search(trace, config, latency, slo, setting=args.search,
                                target=args.target, num_instances=args.instances,
                                policy=args.policy, log=lambda m: print(m, file=sys.stderr))
        if found["value"] is None:
            print(f"no {args.search} up to the search bound meets {args.slo} for "
                  f"{args.target:.0%} of requests")
        else:
            print(f"fewest {args.search} meeting {args.slo} for {args.target:.0%} of requests: "
                  f"{found['value']}")
            print(format_table(found["summary"]))
        if args.json:
            write_json({k: v for k, v in found.items() if k != "tried"}
                       | {"tried": {str(k): v for k, v in found["tried"].items()}}, args.json)
        if args.plot:
            from pagedkv.sim.plots import plot_sweep

            rows = [{"value": k, **v} for k, v in found["tried"].items()]
            plot_sweep(rows, args.search, args.plot, plot_title(args), slo, target=args.target,
                       answer=found["value"], searched=True)
            print(f"plot: {args.plot}", file=sys.stderr)
        return 0
    if args.sweep:
        setting, values = parse_sweep(args.sweep)
        rows = sweep(trace, config, latency, setting, values, slo=slo,
                     num_instances=args.instances, policy=args.policy)
        print(f"{setting:>16} {'ttft p50':>9} {'ttft p99':>9} {'tpot p50':>9} {'e2e p99':>9} "
              f"{'hit':>6} {'preempt':>8} {'goodput':>8}  (ms)")
        for row in rows:
            lat = row["latency"]
            good = row["goodput"]["fraction"] if "goodput" in row else None
            print(f"{row['value']!s:>16} {lat['ttft']['p50'] * 1e3:>9.1f} "
                  f"{lat['ttft']['p99'] * 1e3:>9.1f} {lat['tpot']['p50'] * 1e3:>9.1f} "
                  f"{lat['e2e']['p99'] * 1e3:>9.1f} "
                  f"{row['prefix_cache']['device']['hit_rate']:>6.1%} "
                  f"{row['preemptions']['total']:>8} "
                  f"{'-' if good is None else format(good, '.1%'):>8}")
        if args.json:
            write_json({"sweep": rows}, args.json)
        if args.plot:
            from pagedkv.sim.plots import plot_sweep

            plot_sweep(rows, setting, args.plot, plot_title(args), slo)
            print(f"plot: {args.plot}", file=sys.stderr)
        return 0
    event_log = None
    if args.event_log:
        from pagedkv.sim.event_log import SimEventLog

        event_log = SimEventLog()
    result = simulate(trace, config, latency, num_instances=args.instances, policy=args.policy,
                      on_instance=None if event_log is None else event_log.attach,
                      data_parallel=data_parallel)
    if event_log is not None:
        event_log.write(args.event_log)
        print(f"event log (instance 0, {len(event_log.updates)} updates"
              f"{', truncated' if event_log.truncated else ''}): {args.event_log}; replay it "
              f"with the dashboard's 'replay log'", file=sys.stderr)
    summary = summarize(result, slo)
    print(format_table(summary))
    if args.json:
        write_json(summary, args.json)
    if args.plot:
        from pagedkv.sim.plots import plot_run

        plot_run(result, args.plot, plot_title(args), slo)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


def plot_title(args: argparse.Namespace) -> PlotTitle:
    """The plots' title (`pagedkv.sim.plots.PlotTitle`) from the flags."""
    from pathlib import Path

    from pagedkv.sim.plots import PlotTitle

    return PlotTitle(trace=Path(args.trace).name, model=Path(args.model).name,
                     hardware=Path(args.hardware).name, instances=args.instances,
                     policy=args.policy)


