"""One fresh prompt's prefill step on CPU: its time, and where it goes by op class.

    PYTHONPATH=$PWD python benchmarks/bench_prefill_step.py [--dtype bfloat16] [--tokens 1536]
        [--rounds 20] [--threads 2] [--model PATH] [--profile] [--baseline GIT_REF --repeat 3]

bench_offline.py's random Llama (hidden 512, 8 layers), or `--model` (a model folder or GGUF
file, its weights as the engine loads them by default), block size 32, the fused kernels loaded
(`cpu_kernels="wait"`), a fixed thread count. Each round is one `generate` of one fresh
`--tokens`-token prompt, or of `--prompts` fresh prompts that split the `--tokens` between them
(`--tokens 2048 --prompts 8`: 8 prompts of 256; prefix cache reset, one output token each), so
the prompts are one step: the engine admits them with `prefill_batching="fill"` and a step
budget of at least `--tokens` (the CPU default, 'spread', would start 2,048 queued tokens in
three steps), and a round that takes more than one step stops the run. The runner's step time
is taken around `ModelRunner.execute`. Prints the median step time.

--profile: one more round per layer part under torch.profiler, each op's self time summed by
class (linears by name, attention, norms, RoPE, SiLU-and-mul, KV write, the rest).
--baseline GIT_REF: the timed rounds in child processes, GIT_REF's `pagedkv` against this
tree's, alternating `--repeat` times; prints both medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_offline import SHAPE  # noqa: E402

# Ops by class (by name); an op of no class takes its record_function's class.
OP_CLASSES = {
    "pagedkv_cpu::write_kv_": "KV write",
    "pagedkv_cpu::rms_norm": "norms (+residual)",
    "pagedkv_cpu::add_rms_norm_": "norms (+residual)",
    "pagedkv_cpu::silu_and_mul": "SiLU-and-mul",
    "pagedkv_cpu::rope_": "RoPE",
    "aten::embedding": "embedding",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention (SDPA flash)",
    "pagedkv_cpu::paged_prefill_attention": "attention (fused kernel)",
    "pagedkv_cpu::amx_prefill_attention": "attention (AMX kernel)",
}
LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


def make_llm(model_dir: Path, dtype: str, threads: int, step_tokens: int = 2048):
    """The benchmark engine; a step admits whole prompts up to `step_tokens` (fill)."""
    from pagedkv import LLM

    return LLM(model=str(model_dir), dtype=dtype, seed=0, block_size=32, cpu_threads=threads,
               kv_cache_memory_bytes=1 << 30, cpu_kernels="wait", prefill_batching="fill",
               max_num_batched_tokens=max(step_tokens, 2048))


def timed_execute(runner) -> tuple[list[float], list[float]]:
    """Record the wall seconds and the process's CPU seconds of each runner.execute call into
    the returned lists (mutates runner). On a shared machine the CPU seconds (all threads)
    are the steadier measure."""
    times: list[float] = []
    cpu: list[float] = []
    inner = runner.execute

    def execute(out):
        start, start_cpu = time.perf_counter(), time.process_time()
        try:
            return inner(out)
        finally:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)

    runner.execute = execute
    return times, cpu


def one_step(llm, prompts: list[list[int]], times: list[float]) -> None:
    """One generate of `prompts` (fresh: prefix cache reset), one output token each; raises
    RuntimeError unless it took exactly one step (one more entry in `times`)."""
    from pagedkv import SamplingParams

    llm.llm_engine.scheduler.kv_cache_manager.reset_prefix_cache()
    before = len(times)
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    if len(times) != before + 1:
        raise RuntimeError(f"the {sum(map(len, prompts))} prompt tokens took "
                           f"{len(times) - before} steps, not one")


def linear_modules(model):
    """(label, module) of each of the model's linears, named as LINEARS: dense (`Linear`) or
    packed (a GGUF file's Int4Linear, Int8BlockLinear, PartsLinear...), whose classes differ."""
    for name, mod in model.named_modules():
        short = name.rsplit(".", 1)[-1]
        if short in LINEARS:
            yield "linear " + short, mod


def scope_linears(model) -> None:
    """Wrap each linear's forward in a record_function named after it (mutates the model)."""
    for label, mod in linear_modules(model):
        def forward(x, _inner=mod.forward, _label=label):
            with torch.profiler.record_function(_label):
                return _inner(x)

        mod.forward = forward


def classify(events) -> dict[str, float]:
    """{class: self ms} over the profiler's events (OP_CLASSES, then the linear scopes)."""
    totals: dict[str, float] = defaultdict(float)
    threads = {ev.thread for ev in events if ev.name.startswith("linear ")}
    for ev in events:
        if ev.thread not in threads:
            continue
        cls, node = None, ev
        while node is not None and cls is None:
            if node.name in OP_CLASSES:
                cls = OP_CLASSES[node.name]
            elif node.name.startswith("linear "):
                cls = node.name
            node = node.cpu_parent
        totals[cls or f"other: {ev.name}"] += ev.self_cpu_time_total / 1e3
    return totals


def run(args: argparse.Namespace) -> dict:
    from pagedkv.testing.random_model import build_random_model_dir

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_random_model_dir(Path(tmp) / "m", dtype=args.dtype, seed=0,
                                                     **SHAPE)
        llm = make_llm(model, args.dtype, args.threads, args.tokens)
        rng = random.Random(0)
        vocab = llm.llm_engine.model_config.vocab_size
        each = args.tokens // args.prompts
        prompts = [[rng.randrange(4, vocab) for _ in range(each)] for _ in range(args.prompts)]
        runner = llm.llm_engine.runner
        times, cpu = timed_execute(runner)
        for _ in range(2):
            one_step(llm, prompts, times)
        times.clear()
        cpu.clear()
        for _ in range(args.rounds):
            one_step(llm, prompts, times)
        result = {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
                  "cpu_ms": 1e3 * statistics.median(cpu)}
        if args.profile:
            scope_linears(runner.model)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(args.profile_rounds):
                    one_step(llm, prompts, times)
            result["classes"] = {k: v / args.profile_rounds
                                 for k, v in classify(prof.events()).items()}
            result["profiled_ms"] = 1e3 * statistics.median(times[-args.profile_rounds:])
        llm.shutdown()
    return result


def report(result: dict) -> None:
    print(f"prefill step: median {result['median_ms']:.1f} ms, min {result['min_ms']:.1f} ms, "
          f"median CPU time {result['cpu_ms']:.1f} ms")
    if "classes" not in result:
        return
    total = sum(result["classes"].values())
    print(f"profiled step {result['profiled_ms']:.1f} ms; self time by class (ms per step):")
    for cls, ms in sorted(result["classes"].items(), key=lambda kv: -kv[1]):
        if ms >= 0.1:
            print(f"  {cls:48} {ms:7.2f}  {100 * ms / total:5.1f}%")


def compare(args: argparse.Namespace) -> None:
    from pagedkv.bench.baseline import alternate_with_baseline, median_ratio

    here = str(Path(__file__).resolve().parents[1])
    cmd = [sys.executable, __file__, "--tokens", str(args.tokens), "--prompts", str(args.prompts),
           "--rounds", str(args.rounds), *child_step_bench_args(args)]
    print("load average at the start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), flush=True)
    runs = alternate_with_baseline(
        here, args.baseline, cmd, ("median_ms", "cpu_ms"), args.repeat,
        lambda name, got: f"{name}: wall {got['median_ms']:.1f} ms, CPU {got['cpu_ms']:.1f} ms")
    print("load average at the end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    for key, label in (("median_ms", "wall"), ("cpu_ms", "CPU")):
        this, was = runs["this"][key], runs["base"][key]
        print(f"{args.dtype} {args.tokens} tokens in {args.prompts} prompt(s), {label} ms: "
              f"{args.baseline} {', '.join(f'{x:.1f}' for x in was)}; this tree "
              f"{', '.join(f'{x:.1f}' for x in this)}; median ratio "
              f"{median_ratio(runs, key):.3f}")

def add_step_bench_args(parser: argparse.ArgumentParser) -> None:
    """The options every step benchmark shares (this one's and bench_decode_step.py's)."""
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--baseline", default=None, metavar="GIT_REF")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    parser.add_argument("--model", default=None, help="a model folder or GGUF file (default: "
                        "the random Llama)")


def child_step_bench_args(args: argparse.Namespace) -> list[str]:
    """add_step_bench_args' options a `--baseline` child run repeats (with `--json`)."""
    return ["--dtype", args.dtype, "--threads", str(args.threads), "--json",
            *(["--model", args.model] if args.model else [])]


def step_bench_main(args: argparse.Namespace, run, compare, report) -> None:
    """--baseline: `compare(args)`; else `run(args)`, printed as JSON or by `report`."""
    if args.baseline:
        compare(args)
        return
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        report(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_bench_args(parser)
    parser.add_argument("--tokens", type=int, default=1536)
    parser.add_argument("--prompts", type=int, default=1,
                        help="split --tokens over this many fresh prompts of one step")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--profile-rounds", type=int, default=5)
    step_bench_main(parser.parse_args(), run, compare, report)

if __name__ == "__main__":
    main()
