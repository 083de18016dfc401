"""Host time per decode step of the engine, with a no-op model runner (issue 26).

What is timed is everything `LLMEngine.step()` does around the forward pass: `schedule()`,
`update()` and the output processing (detokenization, stop strings, cumulative outputs), at
32, 128 and 256 running requests. The model runner is replaced by one that samples a fixed
token per request and computes nothing, so the figure is pure host (Python) time: on a GPU it
is the time the device waits between steps unless it is overlapped.

Workload: N requests of 128 prompt tokens, `max_tokens` high enough that none finishes while
timed (`ignore_eos`); after the prefills and `--warmup` decode steps, `--steps` decode steps are
timed one by one, each phase separately, in CPU time of the stepping thread
(time.thread_time_ns: on a shared, oversubscribed machine wall time mostly measures the other
processes; CPU time is the work the step itself costs). The table gives the median
per-step milliseconds of each phase, the core's share (schedule + update + the core's outputs:
what a core process spends between two forward passes), the frontend's (detokenization, stop
strings, cumulative outputs: another process with `pagedkv serve`), and the total; `--repeat` runs alternate the sizes and the
spread column ((max - min) / median of the repeats' medians) shows the machine's noise.

The runner's input preparation (`ModelRunner.prepare_inputs`: the step's token ids, positions,
slot mapping and the attention backend's metadata, block tables included) is host time too, on
the runner's side of the step: the no-op runner runs it on the real runner of the model (and
discards it) and times it apart, in the `prep` column (not in the total).

    PYTHONPATH=$PWD python benchmarks/bench_host_overhead.py [--sizes 32,128,256] [--profile 128]
        [--baseline GIT_REF]

--baseline GIT_REF runs the same measurement on another commit's `pagedkv` (extracted with
`git archive` into a temporary directory) in alternating subprocesses, and prints both totals
and their ratio: the before/after of a change, measured under the same machine load.

Target (issue 26): at most 0.5 ms per step at 128 running requests.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT_LEN = 128


class NoOpRunner:
    """A model runner that computes nothing: every sampling request gets token `token_id`.
    With `real` (a ModelRunner) it also prepares each step's inputs on it, timed in
    `prep_ns` (thread CPU time), and drops them."""

    def __init__(self, token_id: int, real=None) -> None:  # noqa: ANN001
        self.token_id = token_id
        self.real = real
        self.prep_ns = 0

    def execute(self, out):  # noqa: ANN001, ANN201 - the runner's duck type
        from pagedkv.sched.output import ModelRunnerOutput

        if self.real is not None and out.scheduled:
            start = time.thread_time_ns()
            self.real.prepare_inputs(out.scheduled)
            self.prep_ns += time.thread_time_ns() - start
        token = self.token_id
        return ModelRunnerOutput(sampled_token_ids={
            s.request_id: [token] * s.num_samples for s in out.scheduled if s.num_samples})

    def shutdown(self) -> None:
        if self.real is not None:
            self.real.shutdown()


def build_engine(model_dir: Path, max_num_seqs: int):
    from pagedkv.engine.args import EngineArgs
    from pagedkv.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(
        model=str(model_dir), max_num_seqs=max_num_seqs, block_size=16,
        kv_cache_memory_bytes=256 << 20, max_num_batched_tokens=max(8192, PROMPT_LEN * max_num_seqs),
        max_model_len=2048, enforce_eager=True))
    noop = NoOpRunner(token_id=100, real=engine.runner)
    engine.runner = noop
    core = getattr(engine, "core", None)  # after the engine/core split
    if core is not None:
        core.runner = noop
    return engine


class PhaseTimer:
    """Wraps the scheduler's schedule/update and the frontend's output processing (after the
    engine/core split) to time them inside `engine.step()`."""

    def __init__(self, engine) -> None:  # noqa: ANN001
        self.ns = {"schedule": 0, "update": 0, "process": 0}
        for name in ("schedule", "update"):
            inner = getattr(engine.scheduler, name)
            setattr(engine.scheduler, name, self._wrap(name, inner))
        processor = getattr(engine, "outputs", None)
        if processor is not None:
            processor.process = self._wrap("process", processor.process)

    def _wrap(self, name: str, inner):  # noqa: ANN202
        def timed(*args, **kwargs):  # noqa: ANN202
            start = time.thread_time_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                self.ns[name] += time.thread_time_ns() - start
        return timed

    def reset(self) -> None:
        for name in self.ns:
            self.ns[name] = 0


def run_size(model_dir: Path, num_requests: int, steps: int, warmup: int,
             profile: bool = False) -> dict[str, float]:
    """Median milliseconds per decode step: schedule, update, the frontend's output processing
    (0 before the engine/core split, when it was not separable), the core's part (all but the
    frontend's: what a core process spends between forward passes), the total (the runner's
    input preparation left out), and that preparation (`prep`)."""
    from pagedkv.sched.sampling_params import SamplingParams

    engine = build_engine(model_dir, num_requests)
    params = SamplingParams(max_tokens=steps + warmup + 8, ignore_eos=True, temperature=0.0)
    for i in range(num_requests):
        prompt = [4 + (i * 7 + j) % 200 for j in range(PROMPT_LEN)]
        engine.add_request(f"r{i}", prompt, params)
    scheduler = engine.scheduler
    while len(scheduler.running) < num_requests or any(
            r.num_output_tokens == 0 for r in scheduler.running):
        engine.step()
    for _ in range(warmup):
        engine.step()
    timer = PhaseTimer(engine)
    runner = engine.runner
    totals, schedules, updates, processes, preps = [], [], [], [], []
    profiler = cProfile.Profile() if profile else None
    gc.collect()
    for _ in range(steps):
        timer.reset()
        runner.prep_ns = 0
        if profiler is not None:
            profiler.enable()
        start = time.thread_time_ns()
        outputs = engine.step()
        total = time.thread_time_ns() - start
        if profiler is not None:
            profiler.disable()
        if len(outputs) != num_requests:
            raise RuntimeError(f"expected {num_requests} outputs a step, got {len(outputs)}")
        totals.append(total - runner.prep_ns)
        preps.append(runner.prep_ns)
        schedules.append(timer.ns["schedule"])
        updates.append(timer.ns["update"])
        processes.append(timer.ns["process"])
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    engine.shutdown()
    ms = 1e-6
    total = statistics.median(totals) * ms
    schedule = statistics.median(schedules) * ms
    update = statistics.median(updates) * ms
    process = statistics.median(processes) * ms
    return {"schedule": schedule, "update": update, "frontend": process,
            "core": total - process, "total": total, "prep": statistics.median(preps) * ms}


def measure(args: argparse.Namespace) -> dict[int, list[dict[str, float]]]:
    """Each size's per-run results, `args.repeat` runs alternating the sizes."""
    from pagedkv.testing.random_model import build_random_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_model_dir(Path(tmp) / "m", seed=0)
        sizes = [int(s) for s in args.sizes.split(",")]
        runs: dict[int, list[dict[str, float]]] = {n: [] for n in sizes}
        for _ in range(args.repeat):  # alternate the sizes: all see the same machine load
            for n in sizes:
                runs[n].append(run_size(model_dir, n, args.steps, args.warmup))
    return runs


def _child_totals(tree: str, args: argparse.Namespace) -> dict[int, dict[str, float]]:
    """One run of every size in a subprocess importing `pagedkv` from `tree`."""
    cmd = [sys.executable, __file__, "--sizes", args.sizes, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--repeat", "1", "--json"]
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return {int(n): r[0] for n, r in json.loads(out.splitlines()[-1]).items()}


def compare(args: argparse.Namespace) -> None:
    """Alternate runs of `args.baseline`'s pagedkv and this tree's; print totals and ratios."""
    from pagedkv.bench.baseline import baseline_tree

    here = str(Path(__file__).resolve().parents[1])
    with baseline_tree(here, args.baseline) as base:
        results: dict[str, list[dict[int, dict[str, float]]]] = {"base": [], "this": []}
        for _ in range(args.repeat):
            results["base"].append(_child_totals(base, args))
            results["this"].append(_child_totals(here, args))
    print(f"host time per decode step, no-op runner, {cpu_name()}; median ms of {args.repeat} "
          f"alternating runs of {args.steps} steps: {args.baseline} vs this tree")
    print(f"{'running':>8} {'baseline':>9} {'this':>8} {'ratio':>6}   (this: schedule, update, "
          "frontend)   runner prep: baseline, this, ratio")
    for n in results["this"][0]:
        med = {side: statistics.median(r[n]["total"] for r in runs)
               for side, runs in results.items()}
        prep = {side: statistics.median(r[n].get("prep", 0.0) for r in runs)
                for side, runs in results.items()}
        parts = [statistics.median(r[n][k] for r in results["this"])
                 for k in ("schedule", "update", "frontend")]
        prep_ratio = prep["base"] / prep["this"] if prep["this"] else 0.0
        print(f"{n:>8} {med['base']:>9.3f} {med['this']:>8.3f} {med['base'] / med['this']:>5.2f}x"
              f"   ({parts[0]:.3f}, {parts[1]:.3f}, {parts[2]:.3f})"
              f"   {prep['base']:.3f}, {prep['this']:.3f}, {prep_ratio:.2f}x")


def cpu_name() -> str:
    from pagedkv.bench.machine import cpu_name as name

    return name()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="32,128,256")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", type=int, default=0,
                        help="print a cProfile of the timed steps at this size instead")
    parser.add_argument("--baseline", default=None, metavar="GIT_REF",
                        help="also run GIT_REF's pagedkv, alternating, and print the ratio")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline:
        compare(args)
        return
    if args.profile:
        from pagedkv.testing.random_model import build_random_model_dir

        with tempfile.TemporaryDirectory() as tmp:
            model_dir = build_random_model_dir(Path(tmp) / "m", seed=0)
            run_size(model_dir, args.profile, args.steps, args.warmup, profile=True)
        return
    runs = measure(args)
    if args.json:
        print(json.dumps(runs))
        return
    print(f"host time per decode step, no-op runner ({cpu_name()}), "
          f"median ms over {args.steps} steps, median of {args.repeat} runs")
    print(f"{'running':>8} {'schedule':>9} {'update':>8} {'core':>8} {'frontend':>9} "
          f"{'total':>8} {'spread':>7} {'prep':>7}")
    for n, results in runs.items():
        med = {k: statistics.median(r[k] for r in results) for k in results[0]}
        tot = [r["total"] for r in results]
        spread = (max(tot) - min(tot)) / med["total"] if med["total"] else 0.0
        print(f"{n:>8} {med['schedule']:>9.3f} {med['update']:>8.3f} {med['core']:>8.3f} "
              f"{med['frontend']:>9.3f} {med['total']:>8.3f} {spread:>7.0%} {med['prep']:>7.3f}")


if __name__ == "__main__":
    main()
