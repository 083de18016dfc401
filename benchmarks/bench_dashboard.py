"""What the live dashboard costs (issue 23): the same serving workload with and without a
connected dashboard client, the throughput ratio printed.

One in-process `pagedkv serve` app (uvicorn in a thread, a random-weight Llama, prefix caching,
a KV pool small enough that blocks are evicted) serves --runs rounds of the workload twice
each, alternating "off" (no client: the block pool's observer is None) and "on" (a client process, as a browser
is, reads /dashboard/events and parses every update, as the page does). Each round's prompts share a
system prompt of their own, so every round starts from the same cache structure. Output
throughput is generated tokens over wall time; the ratio on/off is printed per round, with the
median and range.

`--engine-core process` runs the engine core in its own process (as `pagedkv serve
--engine-core process`): the feed then crosses as utility calls (pagedkv/engine/utility.py).
Each "on" run also prints the share of its wall time the server's engine loop thread spent
inside utility calls (`CoreClient.call`, waiting for the answer, and `call_async`, sending
it): with the core in its own process that is time it delivers no outputs.

`--account` adds a direct count of the feed's own CPU time in the served rounds with a client:
the pools' op recorders and the feed's drain (engine thread) and the JSON encoding of each update
(event loop), timed in thread CPU time, as a share of the whole server process's CPU time over
the round. Unlike the throughput ratio it is hardly moved by other processes' load, and it is an
upper bound of the feed's cost on a CPU-bound server (the timers' own cost is counted in it).

`--engine-only` measures the engine side alone: offline steps of the same workload with no
watcher, and with the feed subscribed and drained (the same "dashboard.*" utility calls the
server makes, plus JSON-encoding) every 0.1 s; it prints the throughput ratio and the share of
wall time the stepping thread spent on the feed. `--calls blocking` waits for each drain's
answer (`LLMEngine.call_utility`), `--calls async` (the default) starts it and reads the
answer when a later step has received it (`LLMEngine.start_utility`, as the server does).

`--baseline GIT_REF` runs each round twice in child processes, GIT_REF's `pagedkv` (extracted
with `git archive`) and this tree's, alternating, and prints both and their ratio.

    python benchmarks/bench_dashboard.py [--runs 3] [--prompts 48] [--concurrency 8]
                                         [--max-tokens 32] [--model DIR] [--plot PATH] [--json]
                                         [--engine-core inproc|process] [--engine-only]
                                         [--account]
                                         [--calls async|blocking] [--baseline GIT_REF]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPE = dict(hidden_size=256, intermediate_size=688, num_layers=4, num_heads=4, num_kv_heads=2,
             dtype="float32")


def prompts_for(round_index: int, n: int) -> list[list[int]]:
    system = [(round_index * 997 + 31 * i) % 500 + 10 for i in range(192)]  # 12 blocks of 16
    return [system + [(7 * j + i) % 500 + 10 for i in range(40)] for j in range(n)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--model", default=None, help="a model directory (default: random)")
    parser.add_argument("--plot", default=None, help="write a PNG of the runs (matplotlib)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--engine-core", choices=("inproc", "process"), default="inproc",
                        help="where the engine core runs (as pagedkv serve --engine-core)")
    parser.add_argument("--account", action="store_true",
                        help="also time the feed's own code in CPU time (in-process core only)")
    parser.add_argument("--engine-only", action="store_true",
                        help="time the engine loop alone (no HTTP), with and without the feed")
    parser.add_argument("--calls", choices=("async", "blocking"), default="async",
                        help="--engine-only: start each drain and read it later, or wait")
    parser.add_argument("--baseline", default=None, metavar="GIT_REF",
                        help="also run GIT_REF's pagedkv, alternating, and print the ratio")
    parser.add_argument("--round-offset", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from pagedkv.bench.machine import cpu_name
    print(f"CPU: {cpu_name()}; engine core: {args.engine_core}", flush=True)
    if args.baseline:
        return compare(args, argv if argv is not None else sys.argv[1:])

    from pagedkv.engine.args import EngineArgs
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.server.app import create_app
    from pagedkv.server.dashboard.live import DashboardClient, run_traffic, serve_in_thread

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from pagedkv.testing.random_model import build_random_model_dir
            model = str(build_random_model_dir(Path(tmp) / "model", seed=0, **SHAPE))
        engine = LLMEngine(EngineArgs(model=model, block_size=16, max_model_len=512,
                                      num_gpu_blocks_override=args.num_blocks, seed=0),
                           core_process=args.engine_core == "process")
        if args.engine_only:
            rows = [engine_round(engine, r, args) for r in range(args.runs)]
            engine.shutdown()
            return report(rows, args)
        timer = CallTimer(engine.client)
        app = create_app(engine, served_model_name="bench")
        account = FeedAccount() if args.account and args.engine_core == "inproc" else None
        rows = []
        with serve_in_thread(app) as url:
            run_traffic(url, prompts_for(999, args.concurrency), concurrency=args.concurrency,
                        max_tokens=4)  # warm-up
            for r in range(args.round_offset, args.round_offset + args.runs):
                result = {}
                for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                    client = DashboardClient(url) if mode == "on" else None
                    if account is not None and mode == "on":
                        account.start()
                    timer.reset()
                    try:
                        t = run_traffic(url, prompts_for(2 * r + (mode == "on"), args.prompts),
                                        concurrency=args.concurrency,
                                        max_tokens=args.max_tokens)
                    finally:
                        if client is not None:
                            result["updates"], result["ops"] = client.close()
                        if account is not None and mode == "on":
                            result["feed_cpu_share"] = account.stop()
                    result[mode] = t["generated_tokens"] / t["seconds"]
                    if mode == "on":
                        result["call_share"] = timer.seconds / t["seconds"]
                result["ratio"] = result["on"] / result["off"]
                rows.append(result)
                share = (f", feed {100 * result['feed_cpu_share']:.3f}% of the server's CPU"
                         if "feed_cpu_share" in result else "")
                print(f"round {r + 1}: off {result['off']:.1f} tok/s, on {result['on']:.1f} "
                      f"tok/s ({result['updates']} updates, {result['ops']} ops), "
                      f"on/off {result['ratio']:.4f}{share}; engine loop thread in utility "
                      f"calls {100 * result['call_share']:.2f}% of the 'on' run", flush=True)
        engine.check_invariants()
        engine.shutdown()
    return report(rows, args)


class FeedAccount:
    """Times the feed's code in thread CPU time while started: every method of the pools' op
    recorders, `BlockFeed.drain`, and the dashboard route's JSON encoding of updates. `stop()`
    returns that time over the process's CPU time since `start()` and undoes the wrapping."""

    def __init__(self) -> None:
        self.spent_ns = 0
        self._undo: list = []

    def _wrap(self, owner: object, name: str) -> None:
        import time

        inner = getattr(owner, name)

        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            t0 = time.thread_time_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent_ns += time.thread_time_ns() - t0

        setattr(owner, name, timed)
        self._undo.append((owner, name, inner))

    def start(self) -> None:
        import time
        import types

        from pagedkv.engine.block_feed import BlockFeed
        from pagedkv.kv.observer import BlockOpRecorder
        from pagedkv.server.dashboard import routes

        self.spent_ns = 0
        for name in ("on_refs", "on_evicted", "on_cached", "on_uncached", "on_cleared",
                     "on_pins"):
            self._wrap(BlockOpRecorder, name)
        self._wrap(BlockFeed, "drain")
        timed_json = types.SimpleNamespace(dumps=json.dumps, loads=json.loads)
        self._undo.append((routes, "json", routes.json))
        routes.json = timed_json
        self._wrap(timed_json, "dumps")
        self._cpu0 = time.process_time_ns()

    def stop(self) -> float:
        import time

        cpu = time.process_time_ns() - self._cpu0
        for owner, name, inner in reversed(self._undo):
            setattr(owner, name, inner)
        self._undo.clear()
        return self.spent_ns / max(cpu, 1)


class CallTimer:
    """Times a core client's utility calls, made by whichever thread steps the engine: `call`
    (waits for the answer) and, where the client has it, `call_async` (sends the call). Wraps
    the client's methods in place; `seconds` since the last `reset()`."""

    def __init__(self, client) -> None:
        self.seconds = 0.0
        for name in ("call", "call_async"):
            method = getattr(client, name, None)
            if method is not None:
                setattr(client, name, self._timed(method))

    def _timed(self, method):
        def timed(*args):
            start = time.perf_counter()
            try:
                return method(*args)
            finally:
                self.seconds += time.perf_counter() - start
        return timed

    def reset(self) -> None:
        self.seconds = 0.0


class _Feed:
    """The engine-only watcher: drains every 0.1 s, waiting for each answer ("blocking") or
    starting it and JSON-encoding the answer once a later step received it ("async")."""

    def __init__(self, engine, sub: int, calls: str) -> None:
        self.engine, self.sub, self.calls = engine, sub, calls
        self.seconds = 0.0  # the stepping thread's time on the feed
        self.last = time.perf_counter()
        self.waiting = None

    def tick(self) -> None:
        t0 = time.perf_counter()
        if self.waiting is not None and self.waiting.done():
            json.dumps(self.waiting.result(), separators=(",", ":"))
            self.waiting = None
        if self.waiting is None and t0 - self.last >= 0.1:
            self.last = t0
            if self.calls == "blocking":
                json.dumps(self.engine.call_utility("dashboard.drain", self.sub),
                           separators=(",", ":"))
            else:
                self.waiting = self.engine.start_utility("dashboard.drain", self.sub)
        self.seconds += time.perf_counter() - t0


def engine_round(engine, r: int, args: argparse.Namespace) -> dict:
    """One round of the engine-only measurement: off and on, alternating which goes first."""
    from pagedkv.sched.sampling_params import SamplingParams

    result: dict = {}
    for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
        sub = engine.call_utility("dashboard.subscribe")[0] if mode == "on" else None
        feed = _Feed(engine, sub, args.calls) if sub is not None else None
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
        for j, prompt in enumerate(prompts_for(2 * r + (mode == "on"), args.prompts)):
            engine.add_request(f"{r}-{mode}-{j}", prompt, params)
        generated = 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    generated += len(out.outputs[0].token_ids)
            if feed is not None:
                feed.tick()
        wall = time.perf_counter() - start
        feed_s = feed.seconds if feed is not None else 0.0
        if sub is not None:
            engine.call_utility("dashboard.unsubscribe", sub)
            result["feed_share"] = feed_s / wall
            result["updates"], result["ops"] = 0, 0
        result[mode] = generated / wall
    result["ratio"] = result["on"] / result["off"]
    engine.check_invariants()
    print(f"round {r + 1} (engine only, {args.calls} calls): off {result['off']:.1f} tok/s, on {result['on']:.1f} "
          f"tok/s, on/off {result['ratio']:.4f}, feed {100 * result['feed_share']:.2f}% of the "
          f"engine thread's wall time", flush=True)
    return result


def report(rows: list[dict], args: argparse.Namespace) -> int:
    ratios = [r["ratio"] for r in rows]
    summary = {"median_ratio": statistics.median(ratios), "min_ratio": min(ratios),
               "max_ratio": max(ratios), "rounds": rows}
    if "feed_cpu_share" in rows[0]:
        summary["feed_cpu_share_median"] = statistics.median(r["feed_cpu_share"] for r in rows)
        print(f"the feed's own CPU time over the server's, with a client: median "
              f"{100 * summary['feed_cpu_share_median']:.3f}% (max "
              f"{100 * max(r['feed_cpu_share'] for r in rows):.3f}%)")
    if "feed_share" in rows[0]:
        summary["feed_share_median"] = statistics.median(r["feed_share"] for r in rows)
        print(f"feed share of the engine thread: median "
              f"{100 * summary['feed_share_median']:.2f}%")
    if "call_share" in rows[0]:
        summary["call_share_median"] = statistics.median(r["call_share"] for r in rows)
        print(f"engine loop thread in utility calls with a dashboard connected: median "
              f"{100 * summary['call_share_median']:.2f}% of wall time")
    print(f"throughput with a dashboard connected / without: median "
          f"{summary['median_ratio']:.4f} (range {summary['min_ratio']:.4f}-"
          f"{summary['max_ratio']:.4f}, {len(rows)} rounds)")
    if args.json:
        print(json.dumps(summary))
    if args.plot:
        from pagedkv.bench.plot import bar_chart
        bar_chart(args.plot, "dashboard overhead: output tokens/s per round",
                  [f"round {i + 1}" for i in range(len(rows))],
                  {"no client": [r["off"] for r in rows],
                   "dashboard connected": [r["on"] for r in rows]}, ylabel="tokens/s")
    return 0


def compare(args: argparse.Namespace, argv: list[str]) -> int:
    """Each round in two child processes, `args.baseline`'s pagedkv and this tree's,
    alternating; print each round's figures and the medians' ratios."""
    script = str(Path(__file__).resolve())
    here = str(Path(script).parents[1])
    child_argv = [a for i, a in enumerate(argv) if a != "--baseline"
                  and (i == 0 or argv[i - 1] != "--baseline") and not a.startswith("--baseline=")]
    child_argv = [a for i, a in enumerate(child_argv) if a != "--runs"
                  and (i == 0 or child_argv[i - 1] != "--runs")]
    sides: dict[str, list[dict]] = {"base": [], "this": []}
    with tempfile.TemporaryDirectory() as base:
        archive = subprocess.run(["git", "-C", here, "archive", args.baseline, "pagedkv"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", base], input=archive, check=True)
        for r in range(args.runs):
            for side in (("base", "this") if r % 2 == 0 else ("this", "base")):
                tree = base if side == "base" else here  # cwd too: `-m` children look there first
                child = subprocess.run([sys.executable, script, *child_argv, "--runs", "1",
                                        "--round-offset", str(r), "--json"], cwd=tree,
                                       env={**os.environ, "PYTHONPATH": tree},
                                       capture_output=True, text=True)
                if child.returncode != 0:
                    sys.exit(f"the {side} run failed:\n{child.stderr[-3000:]}")
                row = json.loads(child.stdout.splitlines()[-1])["rounds"][0]
                sides[side].append(row)
                print(f"round {r + 1} {side}: " + ", ".join(
                    f"{k} {v:.4f}" for k, v in row.items() if isinstance(v, float)), flush=True)
    print(f"{args.baseline} (base) vs this tree, medians of {args.runs} rounds:")
    for key in ("off", "on", "ratio", "call_share", "feed_share"):
        if key in sides["this"][0] and key in sides["base"][0]:
            base_m = statistics.median(r[key] for r in sides["base"])
            this_m = statistics.median(r[key] for r in sides["this"])
            print(f"  {key}: base {base_m:.4f}, this {this_m:.4f}, this/base "
                  f"{this_m / base_m if base_m else float('nan'):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
