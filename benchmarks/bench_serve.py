"""Online serving, side by side: `pagedkv serve` with its engine core in its own process (the
default), the same server with the core in-process, and optionally vLLM's OpenAI server, on one
random-weight model of the benchmark shape (bench_offline.py's SHAPE), alternating rounds.

Each server is started once per dtype on a free loopback port and loaded by the same client,
`pagedkv bench serve` (random 256-token prompts, 128 output tokens, greedy, ignore_eos), at each
concurrency; the rounds alternate the servers so all see the same machine load. Printed per
point: output tok/s, mean TPOT and mean TTFT of each server (range over the rounds), and the
ratios (median over rounds) against the first server. Both servers get the same step budget
(max_num_batched_tokens 2048, vLLM's CPU default for its API server).

    PYTHONPATH=$PWD python benchmarks/bench_serve.py [--dtypes float32,bfloat16]
        [--concurrency 16,64] [--num-prompts 64] [--rounds 2] [--vs-vllm /tmp/vllm-venv/bin/python]
        [--no-inproc] [--steps] [--variant NAME="PAGEDKV FLAGS" ...]

Each `--variant NAME="FLAGS"` adds one more pagedkv server, `pagedkv:NAME`, started with those
extra `pagedkv serve` flags (e.g. `--variant fill="--prefill-batching fill"`), so two settings
of one option are measured against each other and against vLLM in the same alternating run.

With --steps every engine step is recorded (pagedkv's `--step-log`, vLLM's
`--enable-logging-iteration-details`) and both engines' steps are printed class by class
(anchors_steps.py): how many steps of each kind the same load took, and the median time of one.

Every run also prints, per server, the time outside the model step (serve_host_time.py): the
share of the load's wall its steps filled and the host milliseconds per step around them (with
--steps), and the CPU time per output token of its frontend process (HTTP, SSE, detokenization)
and of its engine core process.

With --vs-vllm PYTHON, vLLM runs as `PYTHON -m vllm.entrypoints.openai.api_server` with the same
block size, KV cache size and max_num_seqs, on the same cores as pagedkv (its OpenMP threads bound
to every CPU of this process, none reserved) with tcmalloc and its libiomp5 preloaded where
found (bench_offline.vllm_env); both engines' settings are printed, and no ratio against vLLM is
printed when its log says it lacks them (bench_offline.vllm_settings_problems). vLLM is never
imported here.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pagedkv.bench.machine import cpu_name

sys.path.insert(0, str(Path(__file__).resolve().parent))
from anchors_steps import Step, pagedkv_steps, print_step_tables, vllm_steps  # noqa: E402
from bench_offline import (  # noqa: E402
    SHAPE,
    engine_settings,
    vllm_env,
    vllm_settings_problems,
)
from serve_host_time import HostTime  # noqa: E402

KV_BYTES = 2 << 30
BLOCK_SIZE = 32
# Both servers' step budget, given explicitly (vLLM's CPU default for its API server, pagedkv's
# default): a scheduling figure compares the same chunked-prefill budget.
MAX_NUM_BATCHED_TOKENS = 2048
LOAD_TIMEOUT_S = 900.0  # one load point (a stuck server fails the run instead of hanging it)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(kind: str, model_dir: Path, dtype: str, port: int, max_num_seqs: int,
                   vllm_python: str | None, step_log: str | None = None,
                   extra_flags: tuple[str, ...] = ()) -> tuple[list[str], dict[str, str]]:
    """The server's command line and environment; `step_log`: record its steps (pagedkv's
    step log at that path, and its request log beside it; vLLM's iteration details in its
    log); `extra_flags`: more `pagedkv serve` flags (a variant's)."""
    env = dict(os.environ)
    if kind == "vllm":
        steps = ["--enable-logging-iteration-details"] if step_log else []
        env = vllm_env(vllm_python, None, KV_BYTES >> 30)
        return [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                "--port", str(port), "--host", "127.0.0.1", "--dtype", dtype,
                "--block-size", str(BLOCK_SIZE), "--max-num-seqs", str(max_num_seqs),
                "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
                "--served-model-name", "m", *steps], env
    mode = "inproc" if kind == "pagedkv-inproc" else "process"
    return [sys.executable, "-m", "pagedkv.cli", "serve", str(model_dir), "--port", str(port),
            "--dtype", dtype, "--block-size", str(BLOCK_SIZE), "--kv-cache-memory-bytes",
            str(KV_BYTES), "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens",
            str(MAX_NUM_BATCHED_TOKENS), "--served-model-name", "m",
            "--log-level", "warning", "--engine-core", mode, *extra_flags,
            *(["--step-log", step_log, "--request-log", step_log + ".requests.jsonl"]
              if step_log else [])], env


def wait_healthy(proc: subprocess.Popen, url: str, kind: str, log_path: str,
                 timeout_s: float = 600.0) -> float:
    """Wait until `url`/health answers 200; the seconds it took. Raises RuntimeError with the
    log's tail when the process exits first or the wait passes `timeout_s`."""
    start = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} exited: {Path(log_path).read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"{kind} not up after {timeout_s:.0f} s")
        time.sleep(0.5)


class Server:
    def __init__(self, kind: str, model_dir: Path, dtype: str, max_num_seqs: int,
                 vllm_python: str | None, record_steps: bool = False,
                 extra_flags: tuple[str, ...] = ()) -> None:
        self.kind = kind
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - open while the server runs
            prefix=f"bench-serve-{kind.replace(':', '-')}-", suffix=".log", delete=False)
        self.step_log = self.log.name + ".steps.jsonl" if record_steps else None
        cmd, env = server_command(kind, model_dir, dtype, self.port, max_num_seqs, vllm_python,
                                  self.step_log, extra_flags)
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.ready_s = wait_healthy(self.proc, self.url, kind, self.log.name)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def steps(self) -> list[Step]:
        """The steps it recorded (with record_steps), the warm-up's included."""
        if self.step_log is None:
            return []
        if self.kind == "vllm":
            return vllm_steps(Path(self.log.name).read_text(errors="replace"))
        return pagedkv_steps(self.step_log)


def load(url: str, concurrency: int, num_prompts: int, vocab: int, seed: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "bench", "serve", "--url", url, "--model", "m",
         "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
         "--input-len", "256", "--output-len", "128", "--vocab-size", str(vocab),
         "--seed", str(seed), "--json", "--no-progress"],
        capture_output=True, text=True, check=True, timeout=LOAD_TIMEOUT_S)
    return json.loads(out.stdout[out.stdout.index("{"):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--concurrency", default="16,64")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--vs-vllm", default=None, metavar="PYTHON")
    parser.add_argument("--no-inproc", action="store_true",
                        help="leave out the in-process pagedkv server")
    parser.add_argument("--steps", action="store_true",
                        help="record every engine step (pagedkv's step log, vLLM's iteration "
                             "details) and print both engines' steps class by class")
    parser.add_argument("--variant", action="append", default=[], metavar='NAME="FLAGS"',
                        help="one more pagedkv server, pagedkv:NAME, with these extra serve "
                             "flags (repeatable)")
    args = parser.parse_args()
    variants = _variants(args.variant)
    from pagedkv.testing.random_model import build_random_model_dir, tokenizer_vocab_size

    kinds = ["pagedkv"] + ([] if args.no_inproc else ["pagedkv-inproc"]) + list(variants) + \
        (["vllm"] if args.vs_vllm else [])
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    print(f"CPU: {cpu_name()}; servers: {kinds}")
    if args.vs_vllm:
        print(engine_settings(vllm_env(args.vs_vllm, None, KV_BYTES >> 30), None))
    problems: list[str] = []
    for dtype in args.dtypes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = build_random_model_dir(Path(tmp) / "m", dtype=dtype, seed=0, **SHAPE)
            vocab = tokenizer_vocab_size(model_dir)
            figures: dict[tuple[str, int], list[dict]] = {}
            steps: dict[str, list[Step]] = {}
            host = {kind: HostTime() for kind in kinds}
            for round_index in range(args.rounds):
                for kind in kinds if round_index % 2 == 0 else kinds[::-1]:
                    server = Server(kind, model_dir, dtype, max(concurrencies), args.vs_vllm,
                                    args.steps, variants.get(kind, ()))
                    try:
                        host[kind].start(server.proc.pid)
                        host[kind].add(server.proc.pid,
                                       load(server.url, concurrencies[0], 8, vocab, 99))  # warm-up
                        for c in concurrencies:
                            # Prompts new to the server at every point: a seed reused on one
                            # server would turn the next point's prefills into prefix hits.
                            seed = 1000 * round_index + c
                            host[kind].start(server.proc.pid)
                            m = load(server.url, c, args.num_prompts, vocab, seed)
                            host[kind].add(server.proc.pid, m)
                            figures.setdefault((kind, c), []).append(m)
                            print(f"  {dtype} c={c} round {round_index} {kind:18} "
                                  f"{m['output_throughput']:8.1f} out tok/s  TPOT "
                                  f"{m['tpot_ms']['mean']:6.1f} ms  TTFT {m['ttft_ms']['mean']:7.1f}"
                                  f" ms  (ready in {server.ready_s:.0f} s)", flush=True)
                    finally:
                        server.stop()
                        steps.setdefault(kind, []).extend(server.steps())
                        if kind == "vllm":
                            problems += vllm_settings_problems(
                                Path(server.log.name).read_text(errors="replace"),
                                len(os.sched_getaffinity(0)))
            _table(dtype, kinds, concurrencies, figures, problems)
            if args.steps:
                print_step_tables(steps)
            print("  outside the step (serve_host_time.py), all load points and rounds:")
            for kind in kinds:
                print(f"    {kind:15} " + host[kind].line([s.ms for s in steps.get(kind, [])]))


def _variants(specs: list[str]) -> dict[str, tuple[str, ...]]:
    """{"pagedkv:NAME": its extra flags} from `NAME=FLAGS` specs; a bad spec exits (one line)."""
    out = {}
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not name.strip():
            raise SystemExit(f"bench_serve.py: --variant wants NAME=FLAGS, got {spec!r}")
        out[f"pagedkv:{name.strip()}"] = tuple(shlex.split(flags))
    return out


def _median_ratio(ours: list[dict], theirs: list[dict], metric) -> float:
    """The median over rounds of ours / theirs of `metric(figures)` (round by round)."""
    return statistics.median(metric(a) / metric(b) for a, b in zip(ours, theirs, strict=True))


def _table(dtype: str, kinds: list[str], concurrencies: list[int],
           figures: dict[tuple[str, int], list[dict]], problems: list[str]) -> None:
    """The summary; no ratio against vLLM where its log showed `problems` (an unfair run)."""
    base = kinds[0]
    metrics = {"tok/s": lambda m: m["output_throughput"], "TPOT": lambda m: m["tpot_ms"]["mean"],
               "TTFT": lambda m: m["ttft_ms"]["mean"]}
    print(f"\n{dtype}: output tok/s, mean TPOT and mean TTFT (min-max over rounds); ratios "
          f"vs the others (median over rounds)")
    for c in concurrencies:
        for kind in kinds:
            runs = figures[(kind, c)]
            spans = {name: (min(map(f, runs)), max(map(f, runs))) for name, f in metrics.items()}
            line = (f"  c={c:<3} {kind:18} {spans['tok/s'][0]:7.1f}-{spans['tok/s'][1]:7.1f} "
                    f"tok/s  TPOT {spans['TPOT'][0]:6.1f}-{spans['TPOT'][1]:6.1f} ms  "
                    f"TTFT {spans['TTFT'][0]:7.1f}-{spans['TTFT'][1]:7.1f} ms")
            if kind == "vllm" and problems:
                line += f"   no ratio: {'; '.join(sorted(set(problems)))}"
            elif kind != base:
                # vLLM against each pagedkv server; a variant against the first server
                for ours in [k for k in kinds if k != "vllm"] if kind == "vllm" else [base]:
                    ratios = {name: _median_ratio(figures[(ours, c)], runs, f)
                              for name, f in metrics.items()}
                    line += f"   {ours}/{kind}: " + ", ".join(
                        f"{r:.2f}x {name}" for name, r in ratios.items())
            print(line)

if __name__ == "__main__":
    main()
