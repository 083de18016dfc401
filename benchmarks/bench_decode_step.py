"""The engine's decode step on CPU at a serving batch: its time, and where it goes by op class.

    PYTHONPATH=$PWD python benchmarks/bench_decode_step.py [--dtype bfloat16] [--batch 16]
        [--prompt 256] [--steps 40] [--threads 2] [--model PATH] [--profile]
        [--baseline GIT_REF --repeat 3]

bench_offline.py's random Llama (SHAPE: hidden 512, 8 layers, 8 heads over 4 KV heads), or
`--model` (a model folder or GGUF file, its weights as the engine loads them by default: a
GGUF file's packed), built through the engine (`LLM`, block size 32, the fused kernels loaded: `cpu_kernels="wait"`), a
fixed thread count. `--batch` requests of `--prompt` to `--prompt` + 63 tokens (greedy, EOS
ignored) are prefilled, then `--steps` decode steps are timed: the engine's whole step
(`LLMEngine.step`: scheduling, the runner, the outputs) and the runner's share of it
(`ModelRunner.execute`: inputs, forward pass, logits, sampling). Prints the medians.

--profile: more decode steps with their parts timed by class (linears by name, decode
attention, KV write, RoPE, norms, SiLU-and-mul, embedding, the sampler), the runner's time
outside them (Python, metadata, glue) and the engine's host time outside the runner. On one
thread (`--threads 1`) each part's time is the thread's CPU time, so other processes on a
shared machine count little; on more threads it is wall-clock time.
--baseline GIT_REF: the timed steps in child processes, GIT_REF's `pagedkv` against this
tree's, alternating `--repeat` times; prints both medians and their ratio (below 1: this tree
is faster).
"""

from __future__ import annotations

import argparse
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
from bench_prefill_step import (  # noqa: E402
    add_step_bench_args,
    child_step_bench_args,
    linear_modules,
    make_llm,
    step_bench_main,
    timed_execute,
)


def fill(llm, batch: int, prompt: int, max_tokens: int, vocab: int) -> None:
    """Add `batch` greedy requests and step the engine until every one has its first token
    (all prefilled: the next steps are decodes only)."""
    from pagedkv import SamplingParams

    engine = llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        ids = [rng.randrange(4, vocab) for _ in range(prompt + i % 64)]
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)


def time_steps(llm, steps: int) -> list[float]:
    """Wall seconds of `steps` engine steps."""
    engine = llm.llm_engine
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        out.append(time.perf_counter() - start)
    return out


class PartTimes:
    """Seconds spent in each wrapped call, by class, on the calling thread's CPU clock
    (time.thread_time: on one thread, the time other processes hold the core does not count)
    or, with more threads, the wall clock (their work runs on other threads)."""

    def __init__(self, threads: int) -> None:
        self.clock = time.thread_time if threads == 1 else time.perf_counter
        self.seconds: dict[str, float] = defaultdict(float)
        self._depth = 0

    def wrap(self, label: str, fn):
        """fn, its time (outermost wrapped calls only) added to `label`."""
        def timed(*a, **kw):
            if self._depth:
                return fn(*a, **kw)
            self._depth += 1
            start = self.clock()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds[label] += self.clock() - start
                self._depth -= 1
        return timed


def wrap_parts(llm, parts: PartTimes) -> None:
    """Time the decode step's parts by class (mutates the engine's runner, its model and the
    kernel op namespace): linears by name, decode attention, KV write, RoPE, norms,
    SiLU-and-mul, embedding, the sampler, the step's inputs, metadata and logits rows; the
    runner's and the engine's step as a whole."""
    engine = llm.llm_engine
    runner = engine.runner
    model = runner.model
    for label, mod in linear_modules(model):
        mod.forward = parts.wrap(label, mod.forward)
    ops = model.ops
    for method, label in (("rope", "RoPE"), ("rms_norm", "norms (+residual)"),
                          ("add_rms_norm", "norms (+residual)"),
                          ("silu_and_mul", "SiLU-and-mul")):
        setattr(ops, method, parts.wrap(label, getattr(ops, method)))
    kernels = torch.ops.pagedkv_cpu
    for op, label in (("paged_decode_attention", "attention (decode kernel)"),
                      ("write_kv_", "KV write")):
        setattr(kernels, op, parts.wrap(label, getattr(kernels, op)))
    model.embed_tokens.forward = parts.wrap("embedding", model.embed_tokens.forward)
    runner.describe_step = parts.wrap("step inputs (describe_step)", runner.describe_step)
    runner.build_metadata = parts.wrap("attention metadata", runner.build_metadata)
    import pagedkv.model.runner as runner_module

    runner_module.select_logits_rows = parts.wrap("logits rows",
                                                  runner_module.select_logits_rows)
    sampler = runner.sampler

    class TimedSampler:
        def __getattr__(self, name):
            return getattr(sampler, name)

        __call__ = staticmethod(parts.wrap("sampler", sampler.__call__))

    runner.sampler = TimedSampler()
    parts.runner, parts.engine = PartTimes(1), PartTimes(1)
    parts.runner.clock = parts.engine.clock = parts.clock
    runner.execute = parts.runner.wrap("runner", runner.execute)
    engine.step = parts.engine.wrap("engine", engine.step)


def profile(llm, steps: int, threads: int) -> dict:
    """{class: ms per step} over `steps` decode steps with their parts timed (PartTimes), with
    the runner's time outside them (Python, metadata, the model's glue) and the engine's host
    time outside the runner."""
    parts = PartTimes(threads)
    wrap_parts(llm, parts)
    time_steps(llm, steps)
    classes = {k: 1e3 * v / steps for k, v in parts.seconds.items()}
    runner_ms = 1e3 * parts.runner.seconds["runner"] / steps
    engine_ms = 1e3 * parts.engine.seconds["engine"] / steps
    classes["runner host (outside the parts)"] = runner_ms - sum(classes.values())
    classes["engine host (outside the runner)"] = engine_ms - runner_ms
    return classes


def run(args: argparse.Namespace) -> dict:
    from pagedkv.testing.random_model import build_random_model_dir

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_random_model_dir(Path(tmp) / "m", dtype=args.dtype, seed=0,
                                                     **SHAPE)
        llm = make_llm(model, args.dtype, args.threads)
        runner = llm.llm_engine.runner
        total = 4 + args.steps + (args.profile_steps if args.profile else 0)
        fill(llm, args.batch, args.prompt, total + 2, llm.llm_engine.model_config.vocab_size)
        times, cpu = timed_execute(runner)
        time_steps(llm, 4)
        times.clear()
        cpu.clear()
        walls = time_steps(llm, args.steps)
        result = {"step_ms": 1e3 * statistics.median(walls),
                  "median_ms": 1e3 * statistics.median(times),
                  "cpu_ms": 1e3 * statistics.median(cpu)}
        if args.profile:
            result["classes"] = profile(llm, args.profile_steps, args.threads)
        llm.shutdown()
    return result


def report(result: dict, args: argparse.Namespace) -> None:
    print(f"decode step, batch {args.batch}: engine step median {result['step_ms']:.2f} ms; "
          f"runner {result['median_ms']:.2f} ms (CPU {result['cpu_ms']:.2f} ms)")
    if "classes" not in result:
        return
    total = sum(result["classes"].values())
    clock = "thread CPU" if args.threads == 1 else "wall"
    print(f"profiled ({clock} ms per step, {total:.2f} in all):")
    for cls, ms in sorted(result["classes"].items(), key=lambda kv: -kv[1]):
        if ms >= 0.05:
            print(f"  {cls:48} {ms:7.2f}  {100 * ms / total:5.1f}%")


def compare(args: argparse.Namespace) -> None:
    from pagedkv.bench.baseline import alternate_with_baseline, median_ratio

    here = str(Path(__file__).resolve().parents[1])
    cmd = [sys.executable, __file__, "--batch", str(args.batch), "--prompt", str(args.prompt),
           "--steps", str(args.steps), *child_step_bench_args(args)]
    keys = (("step_ms", "engine step"), ("median_ms", "runner"), ("cpu_ms", "runner CPU"))
    runs = alternate_with_baseline(
        here, args.baseline, cmd, [key for key, _ in keys], args.repeat,
        lambda name, got: f"{name}: step {got['step_ms']:.2f} ms, runner {got['median_ms']:.2f} ms")
    for key, label in keys:
        this, was = runs["this"][key], runs["base"][key]
        print(f"{args.dtype} batch {args.batch}, {label} ms: {args.baseline} "
              f"{', '.join(f'{x:.2f}' for x in was)}; this tree "
              f"{', '.join(f'{x:.2f}' for x in this)}; median ratio "
              f"{median_ratio(runs, key):.3f}")

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_bench_args(parser)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--profile-steps", type=int, default=10)
    args = parser.parse_args()
    step_bench_main(args, run, compare, lambda result: report(result, args))

if __name__ == "__main__":
    main()
