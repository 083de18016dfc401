"""Offline throughput: pagedkv vs transformers' `generate`, and prefix caching on vs off.

    .venv/bin/python benchmarks/bench_offline.py [--dtypes float32,bfloat16] [--threads N] [--json]
        [--kv-cache-dtype fp8]
    .venv/bin/python benchmarks/bench_offline.py --device cuda [--enforce-eager]  (gpu_offline.py)
    .venv/bin/python benchmarks/bench_offline.py --vs-vllm /tmp/vllm-venv/bin/python [--busy 2]
    .venv/bin/python benchmarks/bench_offline.py --vs-env PAGEDKV_CPU_ISA=avx2 [--dtypes bfloat16]
    .venv/bin/python benchmarks/bench_offline.py --tensor-parallel-size 2  (bench_tensor_parallel.py)
    .venv/bin/python benchmarks/bench_offline.py --first-run [--dtypes float32]
    .venv/bin/python benchmarks/bench_offline.py --compare-kv-cache-dtypes auto,int8,fp8 --threads 1

1. The same random-weight Llama (hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1408)
   and workload through pagedkv (continuous batching) and transformers (static batches of 16,
   left-padded; each batch runs to its longest request; only requested tokens count):
   48 requests, prompts 32-384 tokens, outputs 16-160 tokens, ignore_eos. Output tokens/s for
   both, the ratio, and model FLOP utilization against a matmul measured in the same run.
2. Shared prefix: 32 requests sharing a 1024-token prefix plus 32 unique tokens, 32 output tokens
   each, prefix caching on vs off: prompt tokens computed and wall time.

3. --vs-vllm PYTHON: pagedkv and vLLM's CPU build side by side (README, "pagedkv vs vLLM on
   CPU"): both workloads above, each dtype, each engine in its own subprocess (vLLM's in the
   given interpreter, a throwaway venv) kept up across rounds, runs alternating; block size 32,
   max_num_batched_tokens 2048, prefix caching on, the same 4 GiB KV budget. Prints tok/s per
   run, the ratio of the medians, whether greedy tokens agree, and the load average at start
   and end. --busy N spins N more processes throughout (the shared-machine case).
   --vs-env NAME=VALUE: the same, pagedkv against pagedkv with that environment variable set
   (a baseline of the same engine: e.g. PAGEDKV_CPU_ISA=avx2, the linears before AVX-512).

4. --first-run: a fresh process's first `generate` against its second (issue 26), the mixed
   workload twice on one new `LLM` (the --vs-vllm settings, no warm-up run), with the engine's
   start-up warm-up (pagedkv/engine/warmup.py) and its thread governor counting a long step
   as work, and, as the baseline in the same run, without both (a fresh process each). Prints
   both runs' tok/s and the first / second ratio, and the process's CPU seconds of each run
   (the work done, which other processes' load on a shared machine does not change as much
   as the wall time; with --threads 1 no thread count varies either).

5. --compare-kv-cache-dtypes auto,int8,...: one engine per KV cache format (the --vs-vllm
   settings, prefix caching on, a 1 GiB KV budget each), kept up in this process, running both
   workloads above (--compare-workloads) in alternating rounds (formats in turn, the order
   reversed every other round). Prints each run's output tokens per CPU second of this process
   (with --threads 1 the work done, less disturbed by a shared machine than wall time), each
   format's ratio to the first per round and of the medians, and whether greedy tokens agree.

transformers is a test dependency: install with `pip install -e '.[dev]'` (make test does).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPE = dict(arch="llama", hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8,
             num_kv_heads=4, max_position_embeddings=4096)
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def workload(seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(4, vocab) for _ in range(rng.randint(32, 384))], rng.randint(16, 160))
            for _ in range(48)]


def shared_prefix_workload(seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(4, vocab) for _ in range(1024)]
    return [(prefix + [rng.randrange(4, vocab) for _ in range(32)], 32) for _ in range(32)]


# The side-by-side workloads of --vs-vllm, by name (shared with vllm_offline_worker.py).
WORKLOADS = {
    "mixed": lambda vocab: workload(0, vocab),
    "shared_prefix": lambda vocab: shared_prefix_workload(1, vocab),
    "warmup": lambda vocab: workload(2, vocab)[:4],
}
# Both engines of --vs-vllm: the settings, and the same KV budget (GiB).
VS_ENGINE = dict(block_size=32, max_num_batched_tokens=2048)
VS_KV_GIB = 4


def worker_loop(run) -> None:
    """A --vs-vllm worker's loop (both sides): READY, then for each workload name read from
    stdin, `run(name)` -> {seconds, tokens} printed as `RESULT {json}` with tokens/s added."""
    print("READY", flush=True)
    for line in sys.stdin:
        name = line.strip()
        if not name:
            continue
        result = run(name)
        result["tokens_per_s"] = sum(map(len, result["tokens"])) / result["seconds"]
        print("RESULT " + json.dumps(result), flush=True)


def num_params(model_dir: Path) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = h // cfg["num_attention_heads"]
    attn = h * head_dim * (cfg["num_attention_heads"] * 2 + cfg["num_key_value_heads"] * 2)
    # Matmul parameters per token: layers (attention + MLP) and the LM head.
    return layers * (attn + 3 * h * inter) + h * cfg["vocab_size"]


def matmul_flops(dtype: torch.dtype, n: int = 2048, reps: int = 10) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - start)


def run_pagedkv(model_dir: Path, dtype: str, requests, **engine_kwargs) -> dict:
    from pagedkv import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype=dtype, seed=0, **engine_kwargs)
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    llm.llm_engine.scheduler.kv_cache_manager.reset_prefix_cache()
    before = llm.llm_engine.get_stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = llm.llm_engine.get_stats()
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(p) for p, _ in requests)
    hits = stats.prefix_cache_hits - before.prefix_cache_hits
    return dict(seconds=elapsed, output_tokens=generated, prompt_tokens=prompt_tokens,
                prompt_tokens_computed=prompt_tokens - hits,
                tokens_per_s=generated / elapsed, preemptions=stats.num_preemptions)


def run_transformers(model_dir: Path, dtype: str, requests, batch_size: int = 16) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=TORCH_DTYPES[dtype]).eval()
    pad = 0

    def run_batch(batch):
        longest = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (longest - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p, _ in batch])
        max_new = max(n for _, n in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                           min_new_tokens=max_new, do_sample=False, pad_token_id=pad)

    run_batch(requests[:2])  # warm-up
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        run_batch(requests[i:i + batch_size])
    elapsed = time.perf_counter() - start
    generated = sum(n for _, n in requests)
    return dict(seconds=elapsed, output_tokens=generated, tokens_per_s=generated / elapsed)


def pagedkv_worker(spec: dict) -> None:
    """pagedkv's side of --vs-vllm (this file run with --worker JSON in a subprocess)."""
    from pagedkv import LLM, SamplingParams

    if not spec.get("engine_warmup", True):  # --first-run's baseline: the engine of before
        from pagedkv.engine import compose
        from pagedkv.model.cpu_threads import CpuThreadGovernor

        compose.warm_up = lambda *parts: None
        CpuThreadGovernor.step_done = lambda self: None  # a long step counted as idle
    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, enable_prefix_caching=True,
              block_size=spec["block_size"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              kv_cache_memory_bytes=VS_KV_GIB << 30, cpu_kernels="wait",
              cpu_threads=spec.get("threads"))

    def run(name: str) -> dict:
        requests = WORKLOADS[name](spec["vocab"])
        prompts = [{"prompt_token_ids": p} for p, _ in requests]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
        llm.llm_engine.scheduler.kv_cache_manager.reset_prefix_cache()
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
        gov = llm.llm_engine.runner.thread_governor
        return dict(seconds=elapsed, cpu_seconds=cpu_s,
                    tokens=[list(o.outputs[0].token_ids) for o in outputs],
                    threads=torch.get_num_threads(),
                    others_cores=None if gov is None else round(gov.others_cores, 2))

    if spec.get("warmup_run", True):
        run("warmup")
    worker_loop(run)


class Side:
    """One engine's worker subprocess (kept up across rounds): `run(workload)` -> result."""

    def __init__(self, name: str, cmd: list[str], env: dict) -> None:
        self.name = name
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed with the worker)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env)
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        self.log.seek(0)
        raise RuntimeError(f"{self.name} worker exited:\n{self.log.read()[-3000:]}")

    def run(self, workload_name: str) -> dict:
        settle()
        self.proc.stdin.write(workload_name + "\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("RESULT "))

    def log_text(self) -> str:
        """What the worker wrote to stderr so far (its log)."""
        self.log.seek(0)
        return self.log.read()

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def settle(max_s: float = 15.0) -> None:
    """Wait (at most `max_s`) until the machine is quiet: the side that just ran can keep its
    threads spinning for a second or two after a run (vLLM's OpenMP threads do), which would
    count against the side that runs next."""
    from pagedkv.model.cpu_threads import allowed_cpus, busy_ticks

    cpus, end = allowed_cpus(), time.monotonic() + max_s
    while time.monotonic() < end:
        before = busy_ticks(cpus)
        time.sleep(0.5)
        after = busy_ticks(cpus)
        if before is None or after is None or (after - before) / os.sysconf("SC_CLK_TCK") < 0.075:
            return  # under 0.15 cores busy over the half second (or no /proc to read)


def vllm_env(python: str, threads: int | None, kv_gib: int = VS_KV_GIB) -> dict:
    """The environment vLLM's CPU build wants, on the cores pagedkv gets: tcmalloc and its
    bundled libiomp5 preloaded where found, a KV budget of `kv_gib`, and its OpenMP threads bound
    to every CPU of this process (or the first N, as pagedkv's --threads N) with none reserved
    (pagedkv reserves none)."""
    venv = Path(python).parent.parent  # not resolved: a venv's python links to the base one
    preload = sorted(glob.glob("/usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4"))[:1]
    preload += [str(p) for p in sorted(venv.glob("lib/libiomp5.so"))[:1]]
    preload += [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p and p not in preload]
    cpus = sorted(os.sched_getaffinity(0))[: threads or None]
    return dict(os.environ, LD_PRELOAD=":".join(preload), VLLM_CPU_KVCACHE_SPACE=str(kv_gib),
                VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cpus)),
                VLLM_CPU_NUM_OF_RESERVED_CPU="0")


def pagedkv_env() -> dict:
    """pagedkv's worker environment: tcmalloc preloaded where installed, as `pagedkv serve`
    gives its engine core process (cpu_malloc auto) and vLLM gets here."""
    from pagedkv.model.cpu_memory import find_tcmalloc, with_tcmalloc

    return with_tcmalloc(os.environ, find_tcmalloc())


def engine_settings(env: dict, threads: int | None) -> str:
    """pagedkv's and vLLM's thread and core settings, one line each (what the ratio is of)."""
    cpus = sorted(os.sched_getaffinity(0))
    ours = (f"pagedkv: {threads or len(cpus)} threads over CPUs {cpus}, none reserved, "
            f"LD_PRELOAD={pagedkv_env().get('LD_PRELOAD') or 'nothing'}")
    preload = [Path(p).name for p in env.get("LD_PRELOAD", "").split(":") if p]
    theirs = (f"vLLM: VLLM_CPU_OMP_THREADS_BIND={env.get('VLLM_CPU_OMP_THREADS_BIND')}, "
              f"VLLM_CPU_NUM_OF_RESERVED_CPU={env.get('VLLM_CPU_NUM_OF_RESERVED_CPU')}, "
              f"VLLM_CPU_KVCACHE_SPACE={env.get('VLLM_CPU_KVCACHE_SPACE')} GiB, "
              f"LD_PRELOAD={preload or 'nothing'}")
    return f"{ours}\n{theirs}"


def vllm_settings_problems(log: str, cpus: int) -> list[str]:
    """What vLLM's log says it lacks of a fair run on `cpus` cores: a reserved core, fewer bound
    cores, a missing tcmalloc / libiomp preload. A ratio is not reported when any is found."""
    problems = []
    reserved = re.findall(r"reserved_cpus=\[([^\]]*)\]", log)
    if any(r.strip() for r in reserved):
        problems.append(f"vLLM reserved CPUs [{reserved[-1]}]")
    for ids in re.findall(r"core ids=\[([^\]]*)\]", log):
        if len([i for i in ids.split(",") if i.strip()]) < cpus:
            problems.append(f"vLLM bound its threads to cores [{ids}] of {cpus}")
    for line in log.splitlines():
        if re.search(r"not found in LD_PRELOAD|(tcmalloc|libiomp)\S* (is )?not (found|loaded)",
                     line, re.IGNORECASE):
            problems.append(f"vLLM: {line.strip()[-160:]}")
    return problems


def start_burners(count: int) -> list[subprocess.Popen]:
    """`count` processes that spin on a core each (the busy-machine runs)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def vs_vllm(args: argparse.Namespace, base: Path) -> dict:
    """pagedkv and vLLM side by side (or, with --vs-env, pagedkv and pagedkv with an environment
    variable set: the baseline), alternating, on the issue's workloads; prints the table."""
    report: dict = {"load_start": os.getloadavg(), "busy_processes": args.busy, "rows": []}
    print(f"load average at start: {report['load_start'][0]:.2f}; busy processes: {args.busy}",
          flush=True)
    burners = start_burners(args.busy)
    here = Path(__file__).resolve()
    other = "vllm" if args.vs_vllm else "baseline"
    if args.vs_vllm:
        print(engine_settings(vllm_env(args.vs_vllm, args.threads), args.threads), flush=True)
    try:
        for dtype in args.dtypes.split(","):
            model_dir = Path(args.model) if args.model else random_model(base, dtype)
            from pagedkv.model.registry import model_config_from_dir

            vocab = model_config_from_dir(model_dir).vocab_size
            spec = json.dumps(dict(model=str(model_dir), dtype=dtype, vocab=vocab,
                                   threads=args.threads, **VS_ENGINE))
            ours = [sys.executable, str(here), "--worker", spec]
            if args.vs_vllm:
                theirs = Side(other, [args.vs_vllm, str(here.with_name("vllm_offline_worker.py")),
                                      spec], vllm_env(args.vs_vllm, args.threads))
            else:
                name, _, value = args.vs_env.partition("=")
                theirs = Side(other, ours, dict(os.environ, **{name: value}))
            sides = [Side("pagedkv", ours, pagedkv_env()), theirs]
            cpus = args.threads or len(os.sched_getaffinity(0))
            try:
                for workload_name in ("mixed", "shared_prefix"):
                    results: dict[str, list] = {"pagedkv": [], other: []}
                    for r in range(args.rounds):
                        for side in sides if r % 2 == 0 else sides[::-1]:
                            results[side.name].append(side.run(workload_name))
                    problems = vllm_settings_problems(theirs.log_text(), cpus) \
                        if args.vs_vllm else []
                    report["rows"].append(_vs_row(dtype, workload_name, results, other,
                                                  problems))
            finally:
                for side in sides:
                    side.close()
    finally:
        for p in burners:
            p.kill()
    report["load_end"] = os.getloadavg()
    print(f"load average at end: {report['load_end'][0]:.2f}")
    return report


def first_run(args: argparse.Namespace, base: Path) -> dict:
    """First vs second `generate` of fresh processes, with and without the engine's warm-up."""
    report: dict = {"load_start": os.getloadavg(), "rows": []}
    here = Path(__file__).resolve()
    for dtype in args.dtypes.split(","):
        model_dir = random_model(base, dtype)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        for warm in (False, True):
            spec = json.dumps(dict(model=str(model_dir), dtype=dtype, vocab=vocab,
                                   threads=args.threads, warmup_run=False, engine_warmup=warm,
                                   **VS_ENGINE))
            start = time.perf_counter()
            side = Side("pagedkv", [sys.executable, str(here), "--worker", spec], dict(os.environ))
            ready_s = time.perf_counter() - start
            try:
                results = [side.run("mixed") for _ in range(2)]
            finally:
                side.close()
            runs = [r["tokens_per_s"] for r in results]
            cpu = [r["cpu_seconds"] for r in results]
            label = "with warm-up" if warm else "without (before)"
            print(f"[{dtype}] {label}: ready in {ready_s:.1f} s; first run {runs[0]:,.0f} tok/s, "
                  f"second {runs[1]:,.0f} tok/s: first / second {runs[0] / runs[1]:.2f}; "
                  f"CPU seconds {cpu[0]:.2f} / {cpu[1]:.2f}: second / first "
                  f"{cpu[1] / cpu[0]:.2f}", flush=True)
            report["rows"].append(dict(dtype=dtype, engine_warmup=warm, ready_s=ready_s,
                                       tokens_per_s=runs, cpu_seconds=cpu))
    report["load_end"] = os.getloadavg()
    print(f"load average at start {report['load_start'][0]:.2f}, at end "
          f"{report['load_end'][0]:.2f}")
    return report


def compare_kv_cache_dtypes(args: argparse.Namespace, base: Path) -> dict:
    """Output tokens per CPU second of each KV cache format on each workload, alternating
    rounds; ratios to the first format per round and of the medians (module docstring, 5)."""
    from pagedkv import LLM, SamplingParams

    formats = args.compare_kv_cache_dtypes.split(",")
    report: dict = {"load_start": os.getloadavg(), "rows": []}
    for dtype in args.dtypes.split(","):
        model_dir = random_model(base, dtype)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        engines = {f: LLM(model=str(model_dir), dtype=dtype, seed=0, enable_prefix_caching=True,
                          kv_cache_dtype=f, kv_cache_memory_bytes=1 << 30, cpu_kernels="wait",
                          cpu_threads=args.threads, **VS_ENGINE) for f in formats}
        for name in args.compare_workloads.split(","):
            requests = WORKLOADS[name](vocab)
            prompts = [{"prompt_token_ids": p} for p, _ in requests]
            params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                      for _, n in requests]
            runs: dict[str, list[float]] = {f: [] for f in formats}
            tokens: dict[str, list] = {}
            for r in range(-1, args.rounds):  # round -1: a warm-up, not counted
                for f in formats if r % 2 == 0 else formats[::-1]:
                    llm = engines[f]
                    llm.llm_engine.scheduler.kv_cache_manager.reset_prefix_cache()
                    cpu_start = time.process_time()
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    cpu_s = time.process_time() - cpu_start
                    tokens[f] = [list(o.outputs[0].token_ids) for o in outs]
                    if r >= 0:
                        runs[f].append(sum(map(len, tokens[f])) / cpu_s)
                if r >= 0:
                    first = runs[formats[0]][-1]
                    print(f"[{dtype}] {name} round {r}: " + ", ".join(
                        f"{f} {runs[f][-1]:,.0f}" + ("" if f == formats[0] else
                                                     f" ({runs[f][-1] / first:.2f}x)")
                        for f in formats) + " tok per CPU s", flush=True)
            med = {f: statistics.median(runs[f]) for f in formats}
            same = {f: sum(a == b for a, b in zip(tokens[f], tokens[formats[0]], strict=True))
                    for f in formats}
            print(f"[{dtype}] {name} medians: " + ", ".join(
                f"{f} {med[f]:,.0f} tok per CPU s" + ("" if f == formats[0] else
                                                      f" ({med[f] / med[formats[0]]:.2f}x, greedy "
                                                      f"tokens identical on {same[f]}/"
                                                      f"{len(requests)})")
                for f in formats), flush=True)
            report["rows"].append(dict(dtype=dtype, workload=name, runs=runs, medians=med,
                                       identical_prompts=same))
    report["load_end"] = os.getloadavg()
    print(f"load average at start {report['load_start'][0]:.2f}, at end "
          f"{report['load_end'][0]:.2f}")
    return report


def _vs_row(dtype: str, name: str, results: dict[str, list], other: str,
            problems: list[str] | None = None) -> dict:
    """One table row; with `problems` (vllm_settings_problems) no ratio: the run was unfair."""
    ours = [r["tokens_per_s"] for r in results["pagedkv"]]
    theirs = [r["tokens_per_s"] for r in results[other]]
    a, b = results["pagedkv"][0]["tokens"], results[other][0]["tokens"]
    same = sum(x == y for x, y in zip(a, b, strict=True))
    ratio = None if problems else statistics.median(ours) / statistics.median(theirs)
    verdict = (f"pagedkv / {other} {ratio:.2f}x (medians)" if ratio is not None else
               f"no ratio: {'; '.join(problems)}")
    print(f"[{dtype}] {name}: pagedkv {' / '.join(f'{x:,.0f}' for x in ours)} tok/s, {other} "
          f"{' / '.join(f'{x:,.0f}' for x in theirs)} tok/s: {verdict}; greedy tokens "
          f"identical on {same}/{len(a)} prompts", flush=True)
    return dict(dtype=dtype, workload=name, pagedkv=ours, **{other: theirs}, ratio=ratio,
                identical_prompts=same, prompts=len(a), problems=problems or [])


def random_model(base: Path, dtype: str) -> Path:
    """The benchmark's random Llama (SHAPE) in `dtype` under `base` (built once)."""
    model_dir = base / f"llama-512x8-{dtype}"
    if not (model_dir / "model.safetensors").exists():
        from pagedkv.testing.random_model import build_random_model_dir

        build_random_model_dir(model_dir, dtype=dtype, seed=0, **SHAPE)
    return model_dir


def main(argv: list[str] | None = None) -> int:
    from pagedkv.config.dtypes import KV_CACHE_DTYPE_CHOICES  # not at the top: vLLM's worker

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-shared-prefix", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    parser.add_argument("--model-dir", default=None, help="reuse/cache the random model here")
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="--vs-vllm / --vs-env: this model (a directory or a GGUF file, e.g. "
                             "`python -m pagedkv.testing.real_model`) instead of the random one")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: the 1B-shape workloads of benchmarks/gpu_offline.py instead")
    parser.add_argument("--enforce-eager", action="store_true", help="cuda: no CUDA graphs")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192,
                        help="cuda: the engine's per-step token budget")
    parser.add_argument("--compare-eager", action="store_true",
                        help="cuda: also time the decode step with enforce_eager")
    parser.add_argument("--transformers-mixed", action="store_true",
                        help="cuda: also run transformers on the mixed workload (slow)")
    parser.add_argument("--vs-vllm", metavar="PYTHON", default=None,
                        help="side by side with vLLM in this interpreter (a venv with vLLM's CPU "
                             "build, see the README): both workloads, alternating")
    parser.add_argument("--vs-env", metavar="NAME=VALUE", default=None,
                        help="as --vs-vllm, against pagedkv run with this environment variable "
                             "(the old path: PAGEDKV_CPU_ISA=avx2 keeps 8-wide panels, and "
                             "oneDNN for bfloat16 on a CPU with native bfloat16)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="--vs-vllm / --vs-env / --compare-kv-cache-dtypes: runs per engine")
    parser.add_argument("--first-run", action="store_true",
                        help="a fresh process's first generate vs its second, with and without "
                             "the engine's start-up warm-up")
    parser.add_argument("--busy", type=int, default=0,
                        help="--vs-vllm: spin this many other processes during every run")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                        help="the engine's KV cache dtype (fp8 vs auto at one memory budget: "
                             "benchmarks/bench_kv_quant.py)")
    parser.add_argument("--compare-kv-cache-dtypes", metavar="F,F,...", default=None,
                        help="KV cache formats side by side in one process, alternating rounds "
                             "(--rounds, --compare-workloads): tokens per CPU second and ratios")
    parser.add_argument("--compare-workloads", default="mixed,shared_prefix",
                        help="--compare-kv-cache-dtypes: the workloads to run")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads for every engine in the run (default: torch's); "
                             "1 thread is far less disturbed by other processes on a shared box")
    parser.add_argument("--tensor-parallel-size", type=int, default=None,
                        help="N ranks (one thread each) vs one process with N threads, and the "
                             "share of time in all-reduce (bench_tensor_parallel.py)")
    parser.add_argument("--requests", type=int, default=16,
                        help="--tensor-parallel-size: requests of the mixed workload to run")
    args = parser.parse_args(argv)
    if args.compare_kv_cache_dtypes:
        for flag, value, known in (
                ("--compare-kv-cache-dtypes", args.compare_kv_cache_dtypes, KV_CACHE_DTYPE_CHOICES),
                ("--compare-workloads", args.compare_workloads, WORKLOADS)):
            unknown = sorted(set(value.split(",")) - set(known))
            if unknown:
                parser.error(f"{flag}: unknown {unknown}; known: {sorted(known)}")
    if args.tensor_parallel_size:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_tensor_parallel

        if args.dtypes == parser.get_default("dtypes"):
            args.dtypes = "float32"
        with tempfile.TemporaryDirectory() as tmp:
            report = bench_tensor_parallel.run(args, Path(args.model_dir or tmp), SHAPE, workload)
        if args.json:
            print(json.dumps(report, indent=2))
        return 0
    if args.worker:
        pagedkv_worker(json.loads(args.worker))
        return 0
    if args.vs_env and "=" not in args.vs_env:
        raise ValueError(f"--vs-env must be NAME=VALUE, got {args.vs_env!r}")
    for wanted, mode in ((args.first_run, first_run), (args.vs_vllm or args.vs_env, vs_vllm),
                         (args.compare_kv_cache_dtypes, compare_kv_cache_dtypes)):
        if wanted:
            with tempfile.TemporaryDirectory() as tmp:
                report = mode(args, Path(args.model_dir or tmp))
            if args.json:
                print(json.dumps(report, indent=2))
            return 0
    if args.device == "cuda":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import gpu_offline

        return gpu_offline.main(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    report: dict = {"throughput": {}, "shared_prefix": {}}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.model_dir or tmp)
        for dtype in args.dtypes.split(","):
            model_dir = random_model(base, dtype)
            vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
            requests = workload(0, vocab)
            ours = run_pagedkv(model_dir, dtype, requests, kv_cache_dtype=args.kv_cache_dtype)
            peak = matmul_flops(TORCH_DTYPES[dtype])
            computed = ours["prompt_tokens_computed"] + ours["output_tokens"]
            mfu = 2 * num_params(model_dir) * computed / ours["seconds"] / peak
            row = dict(pagedkv=ours, matmul_flops=peak, pagedkv_mfu=mfu)
            if not args.skip_transformers:
                theirs = run_transformers(model_dir, dtype, requests)
                row["transformers"] = theirs
                row["ratio"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
            report["throughput"][dtype] = row
            print(f"[{dtype}] pagedkv {ours['tokens_per_s']:.1f} tok/s"
                  + (f", transformers {row['transformers']['tokens_per_s']:.1f} tok/s, "
                     f"ratio {row['ratio']:.2f}x" if "ratio" in row else "")
                  + f", MFU {100 * mfu:.1f}% of a {peak / 1e9:.0f} GFLOP/s matmul", flush=True)
            if not args.skip_shared_prefix:
                shared = shared_prefix_workload(1, vocab)
                on = run_pagedkv(model_dir, dtype, shared, enable_prefix_caching=True,
                                 kv_cache_dtype=args.kv_cache_dtype)
                off = run_pagedkv(model_dir, dtype, shared, enable_prefix_caching=False,
                                  kv_cache_dtype=args.kv_cache_dtype)
                speedup = off["seconds"] / on["seconds"]
                report["shared_prefix"][dtype] = dict(caching_on=on, caching_off=off, speedup=speedup)
                print(f"[{dtype}] shared prefix: caching on {on['seconds']:.2f} s "
                      f"({on['prompt_tokens_computed']} prompt tokens computed), off "
                      f"{off['seconds']:.2f} s ({off['prompt_tokens_computed']}): "
                      f"{speedup:.2f}x faster with caching", flush=True)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
