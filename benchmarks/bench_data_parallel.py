"""Data parallelism: `pagedkv serve --data-parallel-size 2` against one core, and the simulator's
`--data-parallel-size 2` against the real run.

Throughput: the same burst of greedy requests (the benchmark model of bench_simulator.py, every
request sent at once) through `pagedkv serve` with one engine core and with two; prints each
run's output tokens per second, the ratio, the requests each core took and whether every
completion's tokens are the same in both runs. CPU threads are the defaults: one core takes
the machine's free cores, two cores split them. On a 2-core machine shared with other work
this measures correctness and the front end's overhead, not a speed-up.

Accuracy (bench_simulator.py's terms): a slice of the Mooncake conversation trace replayed
at its arrivals through a real `--data-parallel-size 2` server (latencies from its request
log, prefix hits and preemptions from /metrics), then through `simulate(...,
data_parallel=True)` on the arrivals the server logged, with the latency model fitted to the
server's own steps (both cores' steps) and the frontend delays fitted from its request log.
Prints the relative error of mean and p99 TTFT, TPOT, E2E, prefix-hit tokens and preemptions,
and how many requests each core took, real and simulated.

    python benchmarks/bench_data_parallel.py [--requests 40] [--burst 24] [--trace T.jsonl]
        [--skip-throughput] [--skip-accuracy]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_simulator as bs  # noqa: E402  (after the path)

SERVE = {k: v for k, v in bs.ENGINE.items() if k != "cpu_threads"}


def per_engine(url: str, name: str) -> dict[str, float]:
    """`vllm:NAME` by its engine label."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == name:
                found[s.labels["engine"]] = found.get(s.labels["engine"], 0.0) + s.value
    return found


async def burst(url: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits,
                                 trust_env=False) as client:
        async def one(prompt: list[int]) -> list[int]:
            r = await client.post("/v1/completions", json={
                "model": "bench", "prompt": prompt, "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0.0, "return_token_ids": True})
            r.raise_for_status()
            return r.json()["choices"][0]["token_ids"]

        return await asyncio.gather(*(one(p) for p in prompts))


def throughput_run(model_dir: Path, prompts: list[list[int]], max_tokens: int, size: int,
                   blocks: int) -> dict:
    from tests.server.helpers import ServerProcess, engine_flags

    proc = ServerProcess(model_dir, *engine_flags(**SERVE, num_gpu_blocks_override=blocks,
                                                  data_parallel_size=size),
                         model_name="bench").start()
    try:
        asyncio.run(burst(proc.url, prompts[:2], 2))  # warm up
        started = time.perf_counter()
        tokens = asyncio.run(burst(proc.url, prompts, max_tokens))
        wall = time.perf_counter() - started
        prompt_tokens = per_engine(proc.url, "vllm:prompt_tokens_total")
    finally:
        proc.stop()
    return {"size": size, "wall_s": wall, "tokens": tokens,
            "tok_per_s": sum(len(t) for t in tokens) / wall, "prompt_tokens": prompt_tokens}


def throughput(args: argparse.Namespace, model_dir: Path, vocab: int) -> dict:
    from pagedkv.sim.traces import load_trace, prompt_token_ids

    trace = load_trace(args.trace, limit=args.burst, scale_lengths=args.scale)
    prompts = [prompt_token_ids(t, vocab, i) for i, t in enumerate(trace)]
    one = throughput_run(model_dir, prompts, args.max_tokens, 1, args.blocks)
    two = throughput_run(model_dir, prompts, args.max_tokens, 2, args.blocks)
    same = one["tokens"] == two["tokens"]
    ratio = two["tok_per_s"] / one["tok_per_s"]
    print(f"throughput: {len(prompts)} requests x {args.max_tokens} tokens: 1 core "
          f"{one['tok_per_s']:.1f} tok/s ({one['wall_s']:.1f} s), 2 cores {two['tok_per_s']:.1f}"
          f" tok/s ({two['wall_s']:.1f} s): ratio {ratio:.2f}; prompt tokens per core "
          f"{two['prompt_tokens']}; tokens equal: {same}", flush=True)
    return {"one": {k: v for k, v in one.items() if k != "tokens"},
            "two": {k: v for k, v in two.items() if k != "tokens"},
            "ratio": ratio, "tokens_equal": same}


def sim_dp_run(trace, config, latency, frontend) -> dict:
    from pagedkv.sim.simulator import simulate

    result = simulate(trace, config, latency, num_instances=2, frontend=frontend,
                      data_parallel=True)
    rows = [{"ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e} for r in result.records]
    return {**bs.metric_stats(rows),
            "hit_tokens": sum(i.scheduler.prefix_cache_hits for i in result.instances),
            "preemptions": sum(i.scheduler.num_preemptions for i in result.instances),
            "requests": len(rows),
            "per_core": [sum(r.instance == c for r in result.records) for c in range(2)],
            "prompt_tokens_per_core": [sum(r.prompt_tokens for r in result.records
                                           if r.instance == c) for c in range(2)]}


def accuracy(args: argparse.Namespace, model_dir: Path, vocab: int, tmp: Path) -> dict:
    from pagedkv.engine.step_log import read_step_log
    from pagedkv.sim.config import SimConfig
    from pagedkv.sim.frontend import FrontendDelays
    from pagedkv.sim.latency import FittedLatency
    from pagedkv.sim.traces import load_trace

    base = load_trace(args.trace, limit=args.requests, scale_lengths=args.scale)
    base = [t for t in base if t.input_length + t.output_length < SERVE["max_model_len"]]
    bs.ENGINE = {**bs.ENGINE, "data_parallel_size": 2}  # real_run's server: two cores
    steps = tmp / "steps.jsonl"
    real_per_core: dict[str, float] = {}
    scrape = bs.scrape

    def scrape_with_cores(url: str) -> dict[str, float]:  # real_run's /metrics read, per core too
        real_per_core.update(per_engine(url, "vllm:prompt_tokens_total"))
        return scrape(url)

    bs.scrape = scrape_with_cores
    real = bs.real_run(model_dir, base, vocab, args.blocks, tmp, steps)
    real_rows = real.pop("rows")
    shapes, times = read_step_log(steps)
    latency = FittedLatency.fit(shapes, times)
    delays = FrontendDelays.fit(real_rows)
    served, _ = bs.as_served(base, real_rows)
    config = SimConfig(num_blocks=args.blocks, block_size=16,
                       max_model_len=SERVE["max_model_len"], vocab_size=vocab,
                       max_num_batched_tokens=2048)
    sim = sim_dp_run(served, config, latency, delays)
    error = bs.errors(sim, real)
    real_tokens = [int(real_per_core.get(str(c), 0)) for c in range(2)]
    print(f"accuracy: {len(base)} requests, 2 cores; {len(times)} server steps (both cores); "
          f"prompt tokens per core: real {real_tokens}, simulated "
          f"{sim['prompt_tokens_per_core']} (requests {sim['per_core']}); errors: "
          + ", ".join(f"{k} {v:+.1%}" for k, v in error.items()), flush=True)
    return {"real": {**real, "prompt_tokens_per_core": real_tokens}, "sim": sim,
            "error": error}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=str(bs.TRACE))
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--burst", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--scale", type=float, default=1 / 32)
    parser.add_argument("--blocks", type=int, default=700)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from pagedkv.testing import build_random_model_dir

    out = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = build_random_model_dir(tmp / "model", dtype="float32", seed=0, **bs.SHAPE)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        if not args.skip_throughput:
            out["throughput"] = throughput(args, model_dir, vocab)
        if not args.skip_accuracy:
            out["accuracy"] = accuracy(args, model_dir, vocab, tmp)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
