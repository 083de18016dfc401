"""Simulator accuracy and speed.

Accuracy: a slice of the Mooncake conversation trace (kvcache-ai/Mooncake, FAST'25, Apache-2.0;
lengths scaled by --scale to the CPU benchmark model) is replayed at about 30%, 70% and 95% of
capacity and at 1.5x overload, once through a real `pagedkv serve` (a client sends each request
at its trace arrival; latencies come from the server's --request-log, preemptions and prefix
hits from its /metrics) and once through `pagedkv simulate`'s core with a latency model fitted on
this machine (`pagedkv profile`'s grid on the same engine flags). Prints the error of mean and
p99 TTFT, TPOT and E2E, of prefix-hit tokens and of preemption counts, one run each.
Capacity: the simulated throughput with every request arriving at once.

The simulator replays the arrivals the server logged (a client on a loaded machine is late),
and each real request is joined to its simulated one (by response id) to compare their
timelines phase by phase (frontend admission, queue, prefill, output hand-over, decode); the
server's steps are split into the step itself and the host gap to the next one. Latency
models: the profile's (CPU time) as is, scaled by the run's wall/CPU ratio, calibrated to the
server's steps (share, per-step and per-request host gaps), and fitted to the server's own
steps; each with and without the frontend delays fitted from the run's request log
(`pagedkv.sim.frontend`). Last, "server steps": the server's own logged step durations
replayed in order (no latency model), which leaves the error of the simulator's decisions and
frontend delays alone and names the first step whose shape differs from the server's.
`--per-request` joins each real request to its simulated twin: TPOT by output length and the
requests with the largest gaps, phase by phase (`--loads 0.7` runs one load point).

Speed: the whole conversation trace (12,031 requests) with `pagedkv simulate`'s defaults (qwen3-8b
on an H100 roofline, block 16), wall and CPU seconds and the cost per simulated request;
`--speed-10x` also runs the trace ten times over (ids offset, so copies share nothing) on a
fleet that serves its rate (`--speed-instances`, default from the 1x run's busy time; one H100
serves about half the trace's rate, so on one instance the queue grows with the trace), and
prints CPU and wall seconds, the cost per request, the peak RSS and the ratio to the 1x run.

    python benchmarks/bench_simulator.py [--requests 80] [--loads 0.3,0.7,0.95,1.5]
        [--trace MOONCAKE.jsonl] [--profile P.json] [--keep-step-logs DIR] [--per-request]
        [--skip-accuracy] [--skip-speed] [--speed-10x [--speed-instances N]] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from pagedkv.bench.datasets import shared_trace  # noqa: E402  (after the path)

TRACE = shared_trace("mooncake_conversation_trace.jsonl")
SHAPE = dict(arch="llama", hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8,
             num_kv_heads=4, max_position_embeddings=4096)
# cpu_kernels="wait": the fused kernels from the first step in both the profile and the
# server (with "auto" the profile could time the slower torch path the server soon leaves).
# cpu_threads=1: on a shared, oversubscribed machine two spinning OpenMP threads stall each
# other at every barrier (steps 10-100x slower and erratic); one thread degrades gracefully.
ENGINE = dict(dtype="float32", block_size=16, max_model_len=4096, cpu_threads=1,
              cpu_kernels="wait")


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[max(1, -(-len(values) * q // 100)) - 1] if values else float("nan")


def metric_stats(rows: list[dict]) -> dict[str, float]:
    out = {}
    for name in ("ttft", "tpot", "e2e"):
        values = [r[name] for r in rows if r.get(name) is not None]
        out[f"{name}_mean"] = statistics.fmean(values) if values else float("nan")
        out[f"{name}_p99"] = percentile(values, 99)
    return out


async def replay(url: str, trace, vocab: int) -> list[str]:
    """Send each request at its arrival (seconds from now); wait for all. Returns each one's
    response id (the server's request log names the engine request `ID-0`). The connection
    pool is unbounded: httpx's default (100 connections) would hold back requests at overload
    and the server would see a throttled trace that the simulator does not."""
    import httpx

    from pagedkv.sim.traces import prompt_token_ids

    ids = [""] * len(trace)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits,
                                 trust_env=False) as client:
        start = time.perf_counter()

        async def one(i, t):
            await asyncio.sleep(max(0.0, t.arrival - (time.perf_counter() - start)))
            r = await client.post("/v1/completions", json={
                "model": "bench", "prompt": prompt_token_ids(t, vocab, i),
                "max_tokens": t.output_length, "ignore_eos": True, "temperature": 0.0})
            r.raise_for_status()
            ids[i] = r.json()["id"]

        await asyncio.gather(*(one(i, t) for i, t in enumerate(trace)))
    return ids


def scrape(url: str) -> dict[str, float]:
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for name in ("prefix_cache_hits_total", "num_preemptions_total", "num_swaps_total"):
        m = re.search(rf"^pagedkv:{name}(?:{{[^}}]*}})?\s+(\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else float("nan")
    return out


def real_run(model_dir: Path, trace, vocab: int, blocks: int, tmp: Path, step_log: Path) -> dict:
    """Serve the trace; its request log gives the latencies and each request's timeline
    (`rows`, in trace order), /metrics the counters, and `step_log` receives the server's
    own steps (`--step-log`)."""
    from pagedkv.jsonl import read_jsonl
    from tests.server.helpers import ServerProcess, engine_flags

    log = tmp / f"log-{time.monotonic_ns()}.jsonl"
    proc = ServerProcess(model_dir, *engine_flags(**ENGINE, num_gpu_blocks_override=blocks,
                                                  step_log=str(step_log)),
                         "--request-log", str(log), model_name="bench").start()
    try:
        ids = asyncio.run(replay(proc.url, trace, vocab))
        counters = scrape(proc.url)
    finally:
        proc.stop()
    by_id = {row["request_id"]: row for row in read_jsonl(log)}
    rows = [by_id[i + "-0"] for i in ids]
    return {**metric_stats(rows), "hit_tokens": counters["prefix_cache_hits_total"],
            "preemptions": counters["num_preemptions_total"], "requests": len(rows),
            "rows": rows}


def as_served(trace, rows: list[dict]) -> tuple[list, list[int]]:
    """The trace with the arrivals the server logged (seconds from the first), sorted by
    them, and each sorted position's index in `trace`: the simulator replays what the server
    saw, not what the client meant to send (a client on a loaded machine is late)."""
    first = min(r["arrival"] for r in rows)
    order = sorted(range(len(trace)), key=lambda i: rows[i]["arrival"])
    return ([dataclasses.replace(trace[i], arrival=rows[i]["arrival"] - first) for i in order],
            order)


def sim_run(trace, config, latency, frontend=None) -> dict:
    from pagedkv.sim.frontend import frontend_of
    from pagedkv.sim.simulator import simulate

    result = simulate(trace, config, latency, frontend=frontend)
    delays = frontend if frontend is not None else frontend_of(latency)
    rows = [{"ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e, "submitted": delays.admit,
             "first_scheduled": r.first_scheduled - r.arrival,
             "engine_first_token": r.ttft - delays.output,
             "engine_last_token": r.e2e - delays.finish} for r in result.records]
    sched = result.instances[0].scheduler
    return {**metric_stats(rows), "hit_tokens": sched.prefix_cache_hits,
            "preemptions": sched.num_preemptions, "requests": len(rows),
            "duration": result.duration, "rows": rows}


PHASES = {  # a request's timeline, in seconds, from request-log-shaped rows
    "admit": lambda r: r["submitted"],
    "queue": lambda r: r["first_scheduled"] - r["submitted"],
    "prefill": lambda r: r["engine_first_token"] - r["first_scheduled"],
    "first out": lambda r: r["ttft"] - r["engine_first_token"],
    "decode": lambda r: r["engine_last_token"] - r["engine_first_token"],
    "last out": lambda r: r["e2e"] - r["engine_last_token"],
}


def spread(rows: list[dict], phase) -> tuple[float, float, float]:
    """The 10th, 50th and 90th percentile of one phase over the rows."""
    values = [phase(r) for r in rows]
    return tuple(percentile(values, q) for q in (10, 50, 90))


def phase_means(rows: list[dict]) -> dict[str, float]:
    """The mean of each phase of the requests' timelines (rows in trace order)."""
    return {name: statistics.fmean(f(r) for r in rows) for name, f in PHASES.items()}


def phase_line(real_rows: list[dict], sim_rows: list[dict], order: list[int]) -> str:
    """Real against simulated mean of each phase, and the mean per-request gap of the
    first-scheduled time (the admission order and timing)."""
    sim_by_trace = [p["sim"] for p in twins(real_rows, sim_rows, order)]
    real, sim = phase_means(real_rows), phase_means(sim_by_trace)
    sched_gap = statistics.fmean(abs(s["first_scheduled"] - r["first_scheduled"])
                                 for r, s in zip(real_rows, sim_by_trace, strict=True))
    return ("phases ms real/sim: " + ", ".join(
        f"{k} {real[k] * 1e3:.1f}/{sim[k] * 1e3:.1f}" for k in PHASES)
        + f"; |first scheduled| off {sched_gap * 1e3:.1f} ms per request")


def twins(real_rows: list[dict], sim_rows: list[dict], order: list[int]) -> list[dict]:
    """Each real request (trace order) joined to its simulated twin: `sim_rows` are in the
    served (arrival) order, `order[pos]` is the trace index of served position `pos`."""
    sim_by_trace = [None] * len(order)
    for pos, i in enumerate(order):
        sim_by_trace[i] = sim_rows[pos]
    return [{"index": i, "real": r, "sim": s}
            for i, (r, s) in enumerate(zip(real_rows, sim_by_trace, strict=True))]


def tpot_breakdown(trace, pairs: list[dict]) -> list[str]:
    """Where the TPOT error comes from: per output-length bucket, the requests' mean real and
    simulated TPOT and the share of the whole mean's error they carry; then the requests
    with the largest TPOT gaps, with their real and simulated timelines (ms)."""
    with_tpot = [p for p in pairs if p["real"]["tpot"] is not None
                 and p["sim"]["tpot"] is not None]
    total = sum(p["sim"]["tpot"] - p["real"]["tpot"] for p in with_tpot) or 1e-12
    lines = []
    for lo, hi in ((2, 2), (3, 5), (6, 10), (11, 10**9)):
        group = [p for p in with_tpot if lo <= trace[p["index"]].output_length <= hi]
        if not group:
            continue
        real = statistics.fmean(p["real"]["tpot"] for p in group)
        sim = statistics.fmean(p["sim"]["tpot"] for p in group)
        err = sum(p["sim"]["tpot"] - p["real"]["tpot"] for p in group)
        lines.append(f"outputs {lo}-{hi if hi < 10**9 else 'up'} tokens: {len(group)} requests,"
                     f" TPOT real {real * 1e3:.1f} ms, sim {sim * 1e3:.1f} ms "
                     f"({sim / real - 1:+.1%}), {err / total:.0%} of the mean's error")
    worst = sorted(with_tpot, key=lambda p: -abs(p["sim"]["tpot"] - p["real"]["tpot"]))[:8]
    for p in worst:
        r, s = p["real"], p["sim"]
        parts = ", ".join(
            f"{name} {f(r) * 1e3:.1f}/{f(s) * 1e3:.1f}" for name, f in PHASES.items())
        lines.append(f"  #{p['index']} out {trace[p['index']].output_length}: TPOT "
                     f"{r['tpot'] * 1e3:.1f}/{s['tpot'] * 1e3:.1f} ms real/sim; {parts}")
    return lines


def step_gaps(path: Path) -> str:
    """The server's steps: the step alone, and the host gap to the next one (delivering
    outputs to the event loop, taking new requests) against the requests in the step."""
    import numpy as np

    from pagedkv.jsonl import read_jsonl

    rows = [r for r in read_jsonl(path) if r["chained"]]
    own = np.array([r["own_seconds"] for r in rows])
    gap = np.array([r["seconds"] - r["own_seconds"] for r in rows])
    seqs = np.array([r["decode_seqs"] + r["prefill_seqs"] for r in rows], dtype=float)
    coef = np.linalg.lstsq(np.stack([np.ones_like(seqs), seqs], 1), gap, rcond=None)[0]
    return (f"{len(rows)} chained steps: own {own.mean() * 1e3:.2f} ms, gap to the next "
            f"{gap.mean() * 1e3:.2f} ms mean ({gap.sum() / (own.sum() + gap.sum()):.1%} of "
            f"the time; {coef[0] * 1e3:.2f} ms + {coef[1] * 1e3:.3f} ms per request)")


def step_check(model_dir: Path, blocks: int, trace, vocab: int, latency) -> dict:
    """Time real `LLMEngine.step()`s on the slice (all arriving at once) against the fitted
    model's prediction for each step's shape: the latency model's own error, without HTTP."""
    from pagedkv.engine.args import EngineArgs
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.sched.sampling_params import SamplingParams
    from pagedkv.sim.latency import StepShape
    from pagedkv.sim.traces import prompt_token_ids

    engine = LLMEngine(EngineArgs(model=str(model_dir), device="cpu",
                                  num_gpu_blocks_override=blocks, **ENGINE))
    sched = engine.scheduler
    captured = []
    real_schedule = sched.schedule

    def schedule():
        captured.append(real_schedule())
        return captured[-1]

    sched.schedule = schedule
    for i, t in enumerate(trace):
        engine.add_request(str(i), prompt_token_ids(t, vocab, i),
                           SamplingParams(max_tokens=t.output_length, ignore_eos=True))
    measured, predicted = [], []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if captured[-1].scheduled:
            measured.append(elapsed)
            predicted.append(latency.step_time(StepShape.of(captured[-1])))
    engine.shutdown()
    ratio = sum(predicted) / sum(measured)
    rel = statistics.fmean(abs(p - m) / m for p, m in zip(predicted, measured, strict=True))
    print(f"step check: {len(measured)} real steps, predicted/measured total {ratio:.2f}, "
          f"mean per-step error {rel:.1%}", flush=True)
    return {"steps": len(measured), "total_ratio": ratio, "mean_step_error": rel}


def errors(sim: dict, real: dict) -> dict[str, float]:
    """Relative error of each simulated figure against the real one (0 = 0 is exact)."""
    return {k: (sim[k] - real[k]) / real[k] if real[k] else
            (0.0 if sim[k] == 0 else float("inf"))
            for k in real if k not in ("requests", "rows")}


def step_errors(latency, shapes, times) -> dict:
    """The latency model's prediction of each logged real step against its duration."""
    predicted = [latency.step_time(s) for s in shapes]
    ratio = sum(predicted) / sum(times)
    rel = statistics.fmean(abs(p - m) / m for p, m in zip(predicted, times, strict=True))
    return {"steps": len(times), "total_ratio": ratio, "mean_step_error": rel}


class ServerSteps:
    """Not a latency model (it is not pure): the server's own logged step durations, in order,
    for the simulator's steps; notes the first step whose shape differs from the server's.
    With them the simulator's error is its decisions' and the frontend's alone."""

    name = "server steps"
    KEYS = ("prefill_tokens", "prefill_seqs", "decode_seqs")

    def __init__(self, path: Path) -> None:
        from pagedkv.jsonl import read_jsonl

        self.rows = list(read_jsonl(path))
        self.count = 0
        self.first_difference: int | None = None

    def step_time(self, shape) -> float:
        k, self.count = self.count, self.count + 1
        row = self.rows[min(k, len(self.rows) - 1)]
        if self.first_difference is None and (
                k >= len(self.rows) or any(getattr(shape, key) != row[key] for key in self.KEYS)):
            self.first_difference = k
        return row["seconds"]


def scaled(latency, factor: float):
    """`latency` with every coefficient times `factor` (the same work at a machine share)."""
    from pagedkv.sim.latency import FittedLatency

    return FittedLatency({k: v * factor for k, v in latency.coefficients.items()}, latency.meta)


def other_loads(logs: dict, load: float) -> tuple[list, list]:
    """(shapes, times) of every load's server steps but `load`'s."""
    shapes, times = [], []
    for other, (s, t) in logs.items():
        if other != load:
            shapes += s
            times += t
    return shapes, times


def accuracy(args: argparse.Namespace) -> list[dict]:
    from pagedkv.engine.args import EngineArgs
    from pagedkv.engine.step_log import read_step_log
    from pagedkv.sim.config import SimConfig
    from pagedkv.sim.frontend import NO_DELAYS, FrontendDelays
    from pagedkv.sim.latency import FittedLatency
    from pagedkv.sim.latency.calibrate import calibrate
    from pagedkv.sim.profiling import profile_model
    from pagedkv.sim.traces import load_trace, scale_trace
    from pagedkv.testing import build_random_model_dir

    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = build_random_model_dir(tmp / "model", dtype="float32", seed=0, **SHAPE)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        # Several prefill chunks per step too (a busy server admits several prompts at once),
        # and chunks past position 0 (a long prompt's later chunks, prefix hits).
        grid = dict(prefill_tokens=(0, 64, 512, 2048), prefill_seqs=(1, 4),
                    prefill_context=(0, 512), decode_seqs=(0, 1, 8, 32), context=(128, 1024))
        t0 = time.perf_counter()
        # The model of the work (the engine thread's CPU time per step shape); its wall time
        # on this shared machine is that times the share other processes leave us, which
        # changes from minute to minute (`wall_over_cpu` when profiled, and per run below).
        if args.profile and Path(args.profile).is_file():
            latency = FittedLatency.load(args.profile)  # the same seeded model and flags
        else:
            latency = profile_model(EngineArgs(model=str(model_dir), device="cpu",
                                               num_gpu_blocks_override=args.blocks, **ENGINE),
                                    grid, repeats=2, clock="cpu")
            if args.profile:
                latency.save(args.profile)
        share = latency.meta["wall_over_cpu"]
        print(f"profiled {latency.meta['samples']} shapes in {time.perf_counter() - t0:.0f} s:"
              f" fit mean error {latency.meta['mean_rel_error']:.1%}, max "
              f"{latency.meta['max_rel_error']:.1%} (CPU time; wall was {share:.2f}x CPU)",
              flush=True)
        config = SimConfig(num_blocks=args.blocks, block_size=16,
                           max_model_len=ENGINE["max_model_len"], vocab_size=vocab,
                           max_num_batched_tokens=2048)
        base = load_trace(args.trace, limit=args.requests, scale_lengths=args.scale)
        base = [t for t in base if t.input_length + t.output_length < ENGINE["max_model_len"]]
        span = base[-1].arrival or 1.0
        burst = [dataclasses.replace(t, arrival=0.0) for t in base]
        if args.step_check:
            step_check(model_dir, args.blocks, burst, vocab, latency)
        capacity = len(burst) / sim_run(burst, config, scaled(latency, share))["duration"]
        native = len(base) / span
        print(f"slice: {len(base)} requests, native rate {native:.2f} req/s; simulated "
              f"capacity {capacity:.2f} req/s at the profile's machine share", flush=True)
        print(f"fitted: {latency.coefficients}", flush=True)
        # Every load's real run first: each load's model may then be calibrated on the
        # OTHER loads' server steps (out of sample: what an operator who calibrated on
        # earlier runs would predict for a new load).
        runs = {}
        for load in [] if args.profile_only else args.loads:
            trace = scale_trace(base, time_scale=native / (load * capacity))
            steps_path = tmp / f"steps-{load}.jsonl"
            runs[load] = (trace, steps_path,
                          real_run(model_dir, trace, vocab, args.blocks, tmp, steps_path))
        logs = {load: read_step_log(path) for load, (_, path, _) in runs.items()}
        for load, (trace, steps_path, real) in runs.items():
            if args.keep_step_logs:
                Path(args.keep_step_logs).mkdir(parents=True, exist_ok=True)
                shutil.copy(steps_path, args.keep_step_logs)
                (Path(args.keep_step_logs) / f"requests-{load}.json").write_text(
                    json.dumps(real["rows"]))
            shapes, times = read_step_log(steps_path)
            cpu_shapes, cpu_times = read_step_log(steps_path, "cpu")
            run_share = sum(times) / sum(cpu_times)
            profile_cpu = step_errors(latency, cpu_shapes, cpu_times)
            print(f"load {load:.0%}: {len(times)} server steps took {sum(times):.2f} s wall, "
                  f"{sum(cpu_times):.2f} s of the engine thread's CPU ({run_share:.2f}x); the "
                  f"profile's model is off their CPU time by {profile_cpu['mean_step_error']:.1%}"
                  f" per step, {profile_cpu['total_ratio']:.3f}x in total", flush=True)
            print(f"load {load:.0%}: {step_gaps(steps_path)}", flush=True)
            real_rows = real.pop("rows")
            delays = FrontendDelays.fit(real_rows)
            print(f"load {load:.0%}: frontend delays (request log medians): admit "
                  f"{delays.admit * 1e3:.2f} ms, output {delays.output * 1e3:.2f} ms, finish "
                  f"{delays.finish * 1e3:.2f} ms, wake {delays.wake * 1e3:.2f} ms; deciles "
                  "(ms) " + "; ".join(f"{name} " + "/".join(
                      f"{q * 1e3:.1f}" for q in spread(real_rows, PHASES[name]))
                      for name in ("admit", "first out", "last out")), flush=True)
            served, order = as_served(trace, real_rows)
            fits = {"profile": latency,
                    "profile x run share": scaled(latency, run_share),
                    "profile calibrated": calibrate(latency, shapes, times),
                    **({"profile calibrated on other loads": calibrate(
                        latency, *other_loads(logs, load))} if len(logs) > 1 else {}),
                    "own steps (wall)": FittedLatency.fit(shapes, times)}
            cal = fits["profile calibrated"].meta["calibration"]
            print(f"load {load:.0%}: profile calibrated to the server's steps: "
                  f"{cal['share']:.2f}x + {cal['per_step'] * 1e3:.2f} ms a step + "
                  f"{cal['per_request'] * 1e3:.3f} ms a request", flush=True)
            for (label, fit), front in itertools.product(fits.items(), (NO_DELAYS, delays)):
                sim = sim_run(served, config, fit, front)
                step = step_errors(fit, shapes, times)
                tag = label + (" +frontend" if front is delays else "")
                rows.append({"load": load, "latency": tag, "real": real, "sim": sim,
                             "error": errors(sim, real), "steps": step,
                             "cpu_steps": profile_cpu, "run_share": run_share,
                             "frontend": delays.to_dict()})
                print(f"load {load:.0%} ({tag}; per-step error on wall "
                      f"{step['mean_step_error']:.1%}, total {step['total_ratio']:.2f}x): "
                      + ", ".join(f"{k} {v:+.1%}" for k, v in rows[-1]["error"].items()),
                      flush=True)
                sim_rows = sim.pop("rows")
                print("    " + phase_line(real_rows, sim_rows, order), flush=True)
                if args.per_request and front is delays:
                    for line in tpot_breakdown(trace, twins(real_rows, sim_rows, order)):
                        print("    " + line, flush=True)
            # The server's own step durations replayed (no jumps: one duration per step):
            # what is left is the decisions' and the frontend model's error.
            replay = ServerSteps(steps_path)
            sim = sim_run(served, dataclasses.replace(config, jump=False), replay, delays)
            sim_rows = sim.pop("rows")
            same = replay.first_difference
            rows.append({"load": load, "latency": "server steps +frontend", "real": real,
                         "sim": sim, "error": errors(sim, real),
                         "steps": {"steps": len(times), "total_ratio": 1.0,
                                   "mean_step_error": 0.0, "simulated": replay.count,
                                   "first_difference": same},
                         "run_share": run_share, "frontend": delays.to_dict()})
            print(f"load {load:.0%} (the server's {len(times)} step durations replayed; "
                  f"{replay.count} simulated steps, "
                  + ("every shape as the server's" if same is None else
                     f"shapes as the server's up to step {same}") + "): "
                  + ", ".join(f"{k} {v:+.1%}" for k, v in rows[-1]["error"].items()),
                  flush=True)
            print("    " + phase_line(real_rows, sim_rows, order), flush=True)
    return rows


def peak_rss_gib() -> float:
    """This process's peak resident memory so far (Linux ru_maxrss is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def queue_memory(trace_path: str, rows: int = 2000) -> dict:
    """Bytes per waiting request (tracemalloc) for the trace's first `rows` rows: a `Request`
    holding its prompt token lists (as the simulator queued them before) against the
    simulator's `LazyPromptRequest` (tokens made at the queue head). Prints the ratio."""
    import tracemalloc

    from pagedkv.sched.request import Request
    from pagedkv.sched.sampling_params import SamplingParams
    from pagedkv.sim.lazy_request import LazyPromptRequest
    from pagedkv.sim.traces import load_trace, prompt_token_ids

    trace, vocab = load_trace(trace_path, limit=rows), 151936

    def params(r):
        return SamplingParams(max_tokens=r.output_length, ignore_eos=True)

    makers = {"eager": lambda i, r: Request(str(i), prompt_token_ids(r, vocab, i), params(r),
                                            arrival_time=r.arrival),
              "lazy": lambda i, r: LazyPromptRequest(str(i), r, vocab, i, params(r), r.arrival)}
    out = {}
    for name, make in makers.items():
        tracemalloc.start()
        kept = [make(i, r) for i, r in enumerate(trace)]
        out[f"{name}_kib"] = tracemalloc.get_traced_memory()[0] / len(kept) / 1024
        tracemalloc.stop()
        del kept
    mean = statistics.fmean(r.input_length for r in trace)
    print(f"a waiting request ({len(trace)} trace rows, {mean:.0f} prompt tokens on average): "
          f"{out['eager_kib']:.1f} KiB with its token lists, {out['lazy_kib']:.1f} KiB lazy "
          f"({out['eager_kib'] / out['lazy_kib']:.0f}x less)", flush=True)
    return out


def repeat_trace(trace: list, copies: int) -> list:
    """`copies` of `trace` back to back (the same rate); block ids offset per copy, so the
    copies share no prefix."""
    span = trace[-1].arrival + 1.0
    offset = 1 + max((i for t in trace for i in t.block_ids), default=0)
    return [dataclasses.replace(t, arrival=t.arrival + c * span,
                                block_ids=tuple(i + c * offset for i in t.block_ids))
            for c in range(copies) for t in trace]


def speed_run(trace: list, config, latency, instances: int, policy: str) -> dict:
    """Simulate `trace` on `instances` instances (`policy` routes between them); prints and
    returns CPU and wall seconds, the cost per request and the process's peak RSS."""
    from pagedkv.sim.simulator import simulate

    cpu, wall = time.process_time(), time.perf_counter()
    result = simulate(trace, config, latency, num_instances=instances, policy=policy or "round-robin")
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    stats = [i.stats for i in result.instances]
    done = sum(r.finish is not None for r in result.records)
    row = {"requests": len(trace), "finished": done, "instances": instances,
           "policy": policy or None, "wall_s": wall, "cpu_s": cpu,
           "cpu_ms_per_request": 1e3 * cpu / len(trace),
           "steps": sum(s.num_steps for s in stats),
           "jumped_steps": sum(s.num_jumped_steps for s in stats),
           "busy_s": sum(s.busy_time for s in stats),
           "simulated_s": result.duration, "peak_rss_gib": peak_rss_gib()}
    fleet = f" on {instances} instances ({policy})" if instances > 1 else " on one instance"
    print(f"speed {len(trace)} requests{fleet}: {wall:.1f} s wall, {cpu:.1f} s CPU, "
          f"{row['cpu_ms_per_request']:.2f} ms CPU per request ({done} finished; {row['steps']} "
          f"steps, {row['jumped_steps']} jumped; {row['simulated_s']:.0f} s simulated for "
          f"{trace[-1].arrival:.0f} s of arrivals); peak RSS {row['peak_rss_gib']:.2f} GiB",
          flush=True)
    return row


def speed(args: argparse.Namespace) -> dict:
    from pagedkv.commands.simulate import add_parser  # the command's own defaults
    from pagedkv.sim.latency import make_latency_model
    from pagedkv.sim.setup import build_sim_config
    from pagedkv.sim.traces import load_trace

    sub = argparse.ArgumentParser().add_subparsers()
    flags = add_parser(sub).parse_args([args.trace])
    config, model_config, hardware = build_sim_config(flags)
    latency = make_latency_model(f"roofline:{hardware}", model_config)
    trace = load_trace(args.trace)
    out = {"queue_memory": queue_memory(args.trace)}
    if args.queue_memory:
        return out
    out["1x"] = speed_run(trace, config, latency, 1, "")
    one = out["1x"]
    # One instance's capacity: the trace's requests over the time its steps took.
    rate, capacity = len(trace) / trace[-1].arrival, len(trace) / one["busy_s"]
    print(f"the trace arrives at {rate:.2f} req/s; one instance serves about {capacity:.2f} "
          "req/s (requests / busy time of the 1x run)", flush=True)
    if args.speed_10x:
        # Ten copies back to back keep the trace's rate: a fleet that serves it (20% headroom)
        # keeps the queues short; on fewer instances the waiting queue grows without bound.
        n = args.speed_instances or max(1, math.ceil(1.2 * rate / capacity))
        big = repeat_trace(trace, 10)
        out["10x"] = speed_run(big, config, latency, n, flags.policy)
        out["10x"]["cpu_ratio_to_1x"] = out["10x"]["cpu_ms_per_request"] / one["cpu_ms_per_request"]
        print(f"10x / 1x CPU per request: {out['10x']['cpu_ratio_to_1x']:.2f}x", flush=True)
    else:
        per_request = one["cpu_s"] / one["requests"]
        out["10x_extrapolated_cpu_s"] = 10 * len(trace) * per_request
        print(f"a 10x trace ({10 * len(trace)} requests) would take about "
              f"{out['10x_extrapolated_cpu_s']:.0f} s CPU at {1e3 * per_request:.2f} ms per "
              "request on one instance (--speed-10x runs it on a fleet that serves its rate)",
              flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--trace", default=str(TRACE),
                        help="the Mooncake conversation trace (default: ../shared/traces)")
    parser.add_argument("--profile", default=None, metavar="JSON",
                        help="load the profiled latency model from here when it exists, else "
                        "profile and save it here (the benchmark's model is seeded, so a "
                        "profile holds for later runs on the same machine)")
    parser.add_argument("--scale", type=float, default=1 / 32,
                        help="length scale for the CPU model (1/32: 512-token blocks -> 16)")
    parser.add_argument("--blocks", type=int, default=700, help="KV blocks of the engine")
    parser.add_argument("--loads", default="0.3,0.7,0.95,1.5")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--step-check", action="store_true",
                        help="also time real engine steps against the fitted model")
    parser.add_argument("--profile-only", action="store_true",
                        help="profile, step check, capacity; no server runs")
    parser.add_argument("--keep-step-logs", default=None, metavar="DIR",
                        help="copy the servers' step logs here (steps-LOAD.jsonl)")
    parser.add_argument("--per-request", action="store_true",
                        help="join each real request to its simulated twin: TPOT by output "
                        "length and the requests with the largest gaps, phase by phase")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--speed-10x", action="store_true",
                        help="also simulate ten copies of the trace back to back")
    parser.add_argument("--queue-memory", action="store_true",
                        help="of the speed part, only the memory of one waiting request")
    parser.add_argument("--speed-instances", type=int, default=None, metavar="N",
                        help="instances for --speed-10x (default: enough to serve the trace's "
                        "rate with 20%% headroom, from the 1x run's busy time)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.loads = [float(x) for x in args.loads.split(",")]
    report: dict = {"cpu": "see the closing note"}
    if not args.skip_accuracy and (rows := accuracy(args)):
        report["accuracy"] = rows
        print(f"\n{'load':>6} {'latency model':>28} {'step err':>9} "
              + " ".join(f"{k:>12}" for k in report["accuracy"][0]["error"]))
        for row in report["accuracy"]:
            print(f"{row['load']:>6.0%} {row['latency']:>28} "
                  f"{row['steps']['mean_step_error']:>9.1%} "
                  + " ".join(f"{v:>+12.1%}" for v in row["error"].values()))
    if not args.skip_speed:
        report["speed"] = speed(args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
