"""Prefill/decode disaggregation measured: 1 prefill + 1 decode instance behind
`pagedkv router --prefill/--decode` against 2 mixed instances behind the kv-aware router, on a
slice of the Mooncake conversation trace (long prompts; lengths scaled to a CPU).

Both fleets serve the same requests at the trace's arrivals (each a streamed, greedy
completion through its router). Prints TTFT and TPOT p50/p99 of each (the client's view,
through the router), the ratios split/mixed, and the transfer per request: after the timed
run each prompt is prefilled once more straight at the producer (a vLLM-proxy prefill request,
its blocks pushed to the consumer again), and its answer's `kv_transfer_params` give the bytes
pushed and the seconds the handoff took.

`--vs-sim` (bench_simulator.py's terms): a latency model is fitted on each split server's own
steps (`--step-log`): the producer's for the prefill side, the consumer's for the decode side
(`simulate_split(decode_latency=...)`: one fit over both is ruled by the long prefill steps and
times decode batches wrong; the decode side's by ordinary least squares, which keeps its steps'
total, the TPOT), and `simulate_split` (what `pagedkv simulate --prefill-instances 1
--decode-instances 1` runs) replays the same requests at the arrivals the client sent them,
over a link of the transfer rate measured above; prints the error of TTFT and TPOT mean and p99.
Then the mixed fleet likewise (2 kv-aware instances, fitted on its own servers' steps), and the
simulator's split/mixed ratios beside the real ones: does it pick the same winner per figure;
and for a grid of SLOs (TTFT and TPOT targets at the real runs' quartiles and 90th percentile)
which fleet serves more requests within each, simulated against real (pagedkv/sim/slo_winner.py).
`--record DIR` writes the run as the fixture of tests/sim/test_split_vs_real.py.

    python benchmarks/bench_pd.py [--requests 24] [--scale 0.0625] [--max-output 24]
        [--time-scale 0.25] [--vs-sim] [--json OUT] [--record DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_simulator as bs  # noqa: E402  (after the path)

from tests.router.helpers import RouterProcess  # noqa: E402

SERVE = dict(bs.ENGINE, max_model_len=2048)
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def push_flags(role: str, kv_port: int) -> list[str]:
    """`--kv-transfer-config` of a producer pushing to `kv_port`, or of its consumer."""
    if role == "producer":
        config = {"kv_role": "kv_producer", "kv_connector": "PagedKVPushConnector",
                  "kv_buffer_size": 2**28,
                  "kv_connector_extra_config": {"consumers": [f"127.0.0.1:{kv_port}"]}}
    else:
        config = {"kv_role": "kv_consumer", "kv_connector": "PagedKVPushConnector",
                  "kv_ip": "127.0.0.1", "kv_port": kv_port, "kv_buffer_size": 2**28}
    return ["--kv-transfer-config", json.dumps(config)]


async def stream_one(client, prompt: list[int], max_tokens: int) -> dict:
    """One streamed greedy completion: TTFT, TPOT and the tokens (chunks) received."""
    start = time.perf_counter()
    first, chunks = None, 0
    async with client.stream("POST", "/v1/completions", json={
            "model": "bench", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True}) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if json.loads(line[6:])["choices"][0].get("text") is not None:
                chunks += 1
                first = first if first is not None else time.perf_counter()
    end = time.perf_counter()
    ttft = (first or end) - start
    return {"ttft": ttft, "tpot": (end - first) / (chunks - 1) if chunks > 1 else None,
            "e2e": end - start, "chunks": chunks}


async def replay(url: str, trace, vocab: int) -> tuple[list[dict], list[float]]:
    """Send each request at its arrival; each one's figures and the second it was sent."""
    import httpx

    from pagedkv.sim.traces import prompt_token_ids

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    sent = [0.0] * len(trace)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits,
                                 trust_env=False) as client:
        start = time.perf_counter()

        async def one(i, t):
            await asyncio.sleep(max(0.0, t.arrival - (time.perf_counter() - start)))
            sent[i] = time.perf_counter() - start
            return await stream_one(client, prompt_token_ids(t, vocab, i), t.output_length)

        rows = await asyncio.gather(*(one(i, t) for i, t in enumerate(trace)))
    return list(rows), sent


def transfers(producer_url: str, trace, vocab: int) -> list[dict]:
    """Each prompt's prefill hop straight at the producer: its kv_transfer_params."""
    import httpx

    from pagedkv.sim.traces import prompt_token_ids

    out = []
    for i, t in enumerate(trace):
        r = httpx.post(producer_url + "/v1/completions", timeout=600, json={
            "model": "bench", "prompt": prompt_token_ids(t, vocab, i), "max_tokens": 1,
            "temperature": 0.0, "kv_transfer_params": PREFILL_PARAMS})
        r.raise_for_status()
        out.append(r.json()["kv_transfer_params"])
    return out


def fleet_run(model_dir: Path, trace, vocab: int, blocks: int, split: bool, tmp: Path) -> dict:
    """Serve `trace` through a split (1P+1D) or mixed (2 kv-aware) fleet."""
    from tests.server.helpers import ServerProcess, engine_flags, free_port

    kv_port = free_port()
    logs = [tmp / f"steps-{split}-{i}.jsonl" for i in range(2)]
    roles = ("producer", "consumer") if split else (None, None)
    servers = [ServerProcess(model_dir, *engine_flags(**SERVE, num_gpu_blocks_override=blocks,
                                                      step_log=str(log)),
                             *(push_flags(role, kv_port) if role else []), model_name="bench")
               for role, log in zip(roles, logs, strict=True)]
    urls = [s.url for s in servers]
    router = (PDRouter(model_dir, urls, "--pd-prefill-timeout", "600") if split
              else RouterProcess(model_dir, urls, "--policy", "kv-aware"))
    try:
        for s in servers:
            s.start()
        router.start()
        # warm both hops with a prompt that shares no block with the trace's (the simulator,
        # replaying the trace alone, would not know of its cached blocks)
        asyncio.run(replay(router.url, [dataclasses.replace(trace[0], block_ids=())], vocab))
        rows, sent = asyncio.run(replay(router.url, trace, vocab))
        params = transfers(urls[0], trace, vocab) if split else []
    finally:
        router.stop()
        for s in servers:
            s.stop()
    assert all(r["chunks"] == t.output_length for r, t in zip(rows, trace, strict=True))
    return {"rows": rows, "sent": sent, "params": params, "step_logs": logs}


class PDRouter(RouterProcess):
    """`pagedkv router --prefill P --decode D` (`backends`: the two URLs)."""

    def command(self) -> list[str]:
        prefill, decode = self.backends
        return [sys.executable, "-m", "pagedkv.cli", "router", "--prefill", prefill,
                "--decode", decode, "--model", str(self.model_dir), "--port", str(self.port),
                "--log-level", "warning", *self.args]


def latency_stats(rows: list[dict]) -> dict[str, float]:
    out = {}
    for name in ("ttft", "tpot"):
        values = [r[name] for r in rows if r.get(name) is not None]
        out[f"{name}_mean"] = statistics.fmean(values)
        out[f"{name}_p50"] = bs.percentile(values, 50)
        out[f"{name}_p99"] = bs.percentile(values, 99)
    return out


def transfer_stats(params: list[dict]) -> dict[str, float]:
    sizes = [p["transfer_bytes"] for p in params]
    seconds = [p["transfer_seconds"] for p in params]
    blocks = sum(p.get("num_blocks", 0) for p in params)
    return {"bytes_mean": statistics.fmean(sizes), "seconds_mean": statistics.fmean(seconds),
            "seconds_p99": bs.percentile(seconds, 99),
            "gbps": 8 * sum(sizes) / sum(seconds) / 1e9 if sum(seconds) else float("inf"),
            "block_bytes": sum(sizes) // blocks if blocks else 0,
            "transferred": sum(1 for p in params if p["num_tokens"] > 0)}


def fitted(run: dict, which: slice = slice(None), absolute: bool = False):
    """The latency model fitted on a fleet run's servers' own steps (those of `which`;
    `absolute`: `FittedLatency.fit`'s), and their number."""
    from pagedkv.engine.step_log import read_step_log
    from pagedkv.sim.latency import FittedLatency

    shapes, times = [], []
    for log in run["step_logs"][which]:
        s, t = read_step_log(log)
        shapes += s
        times += t
    return FittedLatency.fit(shapes, times, absolute=absolute), len(times)


def as_sent(trace, run: dict) -> list:
    """The trace at the arrivals the client sent it (seconds from the first), sorted."""
    first = min(run["sent"])
    order = sorted(range(len(trace)), key=lambda i: run["sent"][i])
    return [dataclasses.replace(trace[i], arrival=run["sent"][i] - first) for i in order]


def vs_sim(trace, split_run: dict, mixed_run: dict, xfer: dict, vocab: int,
           blocks: int) -> dict:
    """simulate_split on the split run's own latency model and arrivals, against the run;
    and the simulator's split/mixed ratios (each fleet on its own fit) against the real ones."""
    from pagedkv.sim.config import SimConfig
    from pagedkv.sim.disagg import Split, simulate_split
    from pagedkv.sim.simulator import simulate
    from pagedkv.sim.slo_winner import flipped, slo_winners

    config = SimConfig(num_blocks=blocks, block_size=SERVE["block_size"],
                       max_model_len=SERVE["max_model_len"], vocab_size=vocab,
                       max_num_batched_tokens=2048, block_bytes=xfer["block_bytes"])
    latency, steps = fitted(split_run, slice(0, 1))
    decode_latency, decode_steps = fitted(split_run, slice(1, 2), absolute=True)
    steps += decode_steps
    result = simulate_split(as_sent(trace, split_run), config, latency,
                            Split(1, 1, xfer["gbps"]), decode_latency=decode_latency)
    sim = latency_stats([{"ttft": r.ttft, "tpot": r.tpot} for r in result.records])
    real = latency_stats(split_run["rows"])
    keys = ("ttft_mean", "ttft_p99", "tpot_mean", "tpot_p99")
    error = {k: (sim[k] - real[k]) / real[k] for k in keys}
    handoff = result.extra["split"]["handoff_seconds_mean"]
    print(f"vs sim: {steps} server steps fitted (producer's and consumer's apart); simulated "
          f"handoff {handoff * 1e3:.0f} ms mean; 1P+1D over {xfer['gbps']:.2f} Gb/s: "
          + ", ".join(f"{k} real {real[k] * 1e3:.1f} ms sim {sim[k] * 1e3:.1f} ms "
                      f"({error[k]:+.1%})" for k in keys), flush=True)
    mixed_latency, _ = fitted(mixed_run)
    mixed = simulate(as_sent(trace, mixed_run), config, mixed_latency, num_instances=2,
                     policy="kv-aware")
    sim_mixed = latency_stats([{"ttft": r.ttft, "tpot": r.tpot} for r in mixed.records])
    real_mixed = latency_stats(mixed_run["rows"])
    ratios = {k: (sim[k] / sim_mixed[k], real[k] / real_mixed[k]) for k in keys}
    print("split / mixed, sim vs real: " + ", ".join(
        f"{k} {s:.2f} vs {r:.2f}" + ("" if (s < 1) == (r < 1) else " (other winner)")
        for k, (s, r) in ratios.items()), flush=True)
    split_rows = [{"ttft": r.ttft, "tpot": r.tpot} for r in result.records]
    mixed_rows = [{"ttft": r.ttft, "tpot": r.tpot} for r in mixed.records]
    decisions = slo_winners((split_run["rows"], mixed_run["rows"]), (split_rows, mixed_rows))
    agree = sum(d["sim_winner"] == d["real_winner"] for d in decisions)
    flips = [d for d in decisions if flipped(d)]
    print(f"which fleet serves more requests within an SLO (by more than one), sim vs real: "
          f"the same in {agree} of {len(decisions)} SLOs, the other fleet in {len(flips)}"
          + "".join(f"; ttft {d['ttft']:.1f} s tpot {d['tpot'] * 1e3:.0f} ms: "
                    f"{d['sim_winner']} vs {d['real_winner']}" for d in flips), flush=True)
    return {"sim": sim, "real": real, "error": error, "sim_mixed": sim_mixed,
            "ratios_sim_real": ratios, "slo_decisions": decisions}


def record(out: Path, trace, split: dict, mixed: dict, xfer: dict, vocab: int,
           blocks: int) -> None:
    """The run as a small fixture: the requests as each fleet's client sent them (trace rows
    with the arrival sent), the client's TTFT and TPOT of each, every server's step log, and
    the config the simulator needs (tests/sim/test_split_vs_real.py reads it back)."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    for name, run in (("split", split), ("mixed", mixed)):
        first = min(run["sent"])
        rows = [{"arrival": run["sent"][i] - first, "input_length": t.input_length,
                 "output_length": t.output_length, "block_ids": list(t.block_ids),
                 "block_tokens": t.block_tokens, "session": t.session,
                 "ttft": r["ttft"], "tpot": r["tpot"]}
                for i, (t, r) in enumerate(zip(trace, run["rows"], strict=True))]
        (out / f"{name}-requests.json").write_text(json.dumps(rows))
        for i, log in enumerate(run["step_logs"]):
            shutil.copy(log, out / f"{name}-steps-{i}.jsonl")
    (out / "config.json").write_text(json.dumps({
        "num_blocks": blocks, "block_size": SERVE["block_size"],
        "max_model_len": SERVE["max_model_len"], "vocab_size": vocab,
        "max_num_batched_tokens": 2048, "block_bytes": xfer["block_bytes"],
        "link_gbps": xfer["gbps"]}, indent=1))


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def line(name: str, stats: dict) -> str:
    return (f"{name}: TTFT p50 {stats['ttft_p50'] * 1e3:.0f} ms p99 {stats['ttft_p99'] * 1e3:.0f}"
            f" ms, TPOT p50 {stats['tpot_p50'] * 1e3:.1f} ms p99 {stats['tpot_p99'] * 1e3:.1f} ms")


def load_trace(args: argparse.Namespace):
    from pagedkv.sim.traces import load_trace as read

    trace = read(args.trace, limit=args.requests, scale_lengths=args.scale,
                 time_scale=args.time_scale)
    trace = [dataclasses.replace(t, output_length=max(2, min(t.output_length, args.max_output)))
             for t in trace]
    return [t for t in trace if t.input_length + t.output_length < SERVE["max_model_len"]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=str(bs.TRACE))
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--scale", type=float, default=1 / 16, help="prompt/output lengths")
    parser.add_argument("--time-scale", type=float, default=1.0, help="arrival times")
    parser.add_argument("--max-output", type=int, default=24)
    parser.add_argument("--blocks", type=int, default=1200)
    parser.add_argument("--vs-sim", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--record", default=None, metavar="DIR",
                        help="write the run to DIR as the fixture of tests/sim/test_split_vs_real.py")
    args = parser.parse_args()
    from pagedkv.bench.machine import cpu_name
    from pagedkv.testing import build_random_model_dir

    trace = load_trace(args)
    prompts = [t.input_length for t in trace]
    print(f"{cpu_name()}; load: {uptime()}")
    print(f"{len(trace)} requests of the Mooncake conversation trace x{args.scale:g}: prompts "
          f"mean {statistics.fmean(prompts):.0f} max {max(prompts)} tokens, outputs <= "
          f"{args.max_output}, over {trace[-1].arrival:.1f} s", flush=True)
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = build_random_model_dir(tmp / "model", dtype="float32", seed=0, **bs.SHAPE)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        split = fleet_run(model_dir, trace, vocab, args.blocks, True, tmp)
        mixed = fleet_run(model_dir, trace, vocab, args.blocks, False, tmp)
        out["split"], out["mixed"] = latency_stats(split["rows"]), latency_stats(mixed["rows"])
        out["transfer"] = xfer = transfer_stats(split["params"])
        print(line("1 prefill + 1 decode", out["split"]))
        print(line("2 mixed (kv-aware)  ", out["mixed"]))
        out["ratio"] = {k: out["split"][k] / out["mixed"][k] for k in out["split"]}
        print("split / mixed: " + ", ".join(f"{k} {v:.2f}" for k, v in out["ratio"].items()))
        print(f"transfer per request: {xfer['bytes_mean'] / 1e6:.2f} MB, "
              f"{xfer['seconds_mean'] * 1e3:.1f} ms mean, {xfer['seconds_p99'] * 1e3:.1f} ms p99"
              f" ({xfer['gbps']:.2f} Gb/s); {xfer['transferred']}/{len(trace)} transferred",
              flush=True)
        if args.vs_sim:
            out["vs_sim"] = vs_sim(trace, split, mixed, xfer, vocab, args.blocks)
        if args.record:
            record(Path(args.record), trace, split, mixed, xfer, vocab, args.blocks)
    print(f"load after: {uptime()}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
