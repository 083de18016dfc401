"""bench_serve.py's closed loop (C clients, each sending its next request when its last one
ends; 256-token prompts, 128 output tokens) through the simulator with the real scheduler, on a
latency model fitted to a real run's step log (`pagedkv serve --step-log`, which `bench_serve.py
--steps` writes), once per scheduling setting: what each setting does to mean TTFT, mean TPOT
and output tok/s on this machine's step costs, without the noise of a shared machine.

    PYTHONPATH=$PWD python benchmarks/sim_closed_loop.py STEP_LOG [STEP_LOG ...]
        [--clock cpu] [--concurrency 16,64] [--num-prompts 64]
        [--setting fill --setting spread:256:16 ...]

A setting is `fill`, or `spread:STEP_OVERHEAD:DECODE_OVERHEAD` (prefill_batching and its two
overhead options). `--clock cpu` fits the steps' CPU time (the engine thread's: less of other
processes' load in it) instead of their wall time. Ratios are against the first setting.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pagedkv.engine.step_log import read_step_log
from pagedkv.sim.closed_loop import simulate_closed_loop
from pagedkv.sim.config import SimConfig
from pagedkv.sim.latency.fitted import FittedLatency

BUDGET = 2048  # bench_serve.MAX_NUM_BATCHED_TOKENS


def setting(text: str) -> dict:
    """`fill` or `spread:STEP:DECODE` -> SimConfig keywords; SystemExit naming a bad one."""
    name, *numbers = text.split(":")
    if name == "fill" and not numbers:
        return {"prefill_batching": "fill"}
    if name == "spread" and len(numbers) == 2 and all(n.isdigit() for n in numbers):
        return {"prefill_batching": "spread", "prefill_step_overhead_tokens": int(numbers[0]),
                "prefill_decode_overhead_tokens": int(numbers[1])}
    raise SystemExit(f"sim_closed_loop.py: a setting is fill or spread:STEP:DECODE, got {text!r}")


def fitted(paths: list[str], clock: str) -> FittedLatency:
    shapes, times = [], []
    for path in paths:
        more_shapes, more_times = read_step_log(Path(path), clock)
        shapes += more_shapes
        times += more_times
    return FittedLatency.fit(shapes, times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step_logs", nargs="+")
    parser.add_argument("--clock", choices=("wall", "cpu", "own"), default="wall")
    parser.add_argument("--concurrency", default="16,64")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--setting", action="append", default=[])
    args = parser.parse_args()
    settings = [setting(s) for s in args.setting or ["fill", "spread:256:16"]]
    latency = fitted(args.step_logs, args.clock)
    fit = latency.meta
    print(f"fitted on {fit['samples']} steps ({args.clock} clock), mean relative error "
          f"{fit['mean_rel_error']:.3f}")
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        first = None
        for keywords in settings:
            config = SimConfig(num_blocks=4096, block_size=32, max_num_seqs=concurrency,
                               max_num_batched_tokens=BUDGET, **keywords)
            result = simulate_closed_loop(config, latency, concurrency=concurrency,
                                          num_prompts=args.num_prompts, input_len=256,
                                          output_len=128)
            first = first or result
            label = ":".join(str(v) for v in keywords.values())
            print(f"  c={concurrency:<3} {label:16} TTFT {1e3 * result.mean_ttft:8.1f} ms "
                  f"({result.mean_ttft / first.mean_ttft:.2f}x)  TPOT "
                  f"{1e3 * result.mean_tpot:6.2f} ms ({result.mean_tpot / first.mean_tpot:.3f}x)"
                  f"  {result.output_throughput:7.1f} tok/s "
                  f"({result.output_throughput / first.output_throughput:.3f}x)  "
                  f"{result.num_steps} steps")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
