"""Where the time goes on the offline shared-prefix workload, and a before/after of a change.

    PYTHONPATH=$PWD python benchmarks/bench_shared_prefix.py [--dtypes float32,bfloat16]
        [--runs 3] [--workloads shared_prefix,mixed] [--baseline GIT_REF] [--threads 1]
        [--torch-profile]

The workloads and engine settings of `bench_offline.py --vs-vllm` (the random-weight Llama of
hidden 512 x 8 layers; block size 32, max_num_batched_tokens 2048, prefix caching on): 32
requests sharing a 1,024-token prefix plus 32 unique tokens each, 32 output tokens each
("shared_prefix"), and the 48 mixed requests ("mixed"). Each run is timed whole (output tok/s)
and split into phases by wrapping the functions that do the work, exclusive wall time each
(a phase's time excludes the phases it calls):

- `linear`: every projection (layers.Linear: panel_linear or oneDNN);
- `elementwise`: RMSNorm, residual add, SiLU-and-mul, RoPE (model/ops.py LayerOps);
- `attn.write_kv`, `attn.decode` (the fused decode kernel or the torch decode path),
  `attn.cascade_prefix` (a shared prefix attended once: cascade.shared_prefix_attention; the
  whole cascade of prefill chunks on AMX tiles, cpu_native.PrefillCascade, own keys and merge
  included), `attn.merge` (merge_states; none where the AMX kernel merges in place: a decode's
  in `attn.decode`), `attn.prefill_own` (a cascade chunk's own keys),
  `attn.prefill` (prefill chunks without a shared prefix; every prefill chunk where the tiled
  kernel `paged_prefill_attention` takes them), `attn.other` (the rest of
  `attend`: metadata, indexing, the cascade's glue);
- `forward.other` (the model's forward outside the above: embedding, views), `logits+sample`,
  `runner.other` (step description, metadata building, tensors from lists);
- `host` (the engine's step outside the runner: schedule, update, output processing).

Per phase: milliseconds per run, split into steps with a prefill chunk and decode-only steps.
Wrapping costs a few microseconds per call, in every phase alike. --threads 1: one torch thread
and every time (phases and the run) the stepping thread's CPU time (time.thread_time): the
work itself, which a shared, oversubscribed machine disturbs far less than wall time; the
default (the thread governor's threads) times wall clock.

--baseline GIT_REF: the same runs, alternating, of another commit's `pagedkv` (extracted with
`git archive`) in its own subprocess, and this tree's; prints both breakdowns and the ratio of
the median tok/s (this / baseline). --torch-profile: also the top torch ops of one run by
self CPU time (torch.profiler, this tree only).
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
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent


class PhaseTimer:
    """Exclusive time per phase name, per step kind ("prefill" / "decode"): wall time, or with
    `clock` time.thread_time the stepping thread's CPU time."""

    def __init__(self, clock=time.perf_counter) -> None:  # noqa: ANN001
        self.clock = clock
        self.totals: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.stack: list[list] = []  # [name, start, child seconds]
        self.kind = "decode"

    def wrap(self, owner: object, attr: str, name: str) -> None:
        """Replace owner.attr (a function or method) by a timed one, if it exists."""
        inner = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if inner is None:
            return
        timer = self

        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            frame = [name, timer.clock(), 0.0]
            timer.stack.append(frame)
            try:
                return inner(*args, **kwargs)
            finally:
                timer.stack.pop()
                elapsed = timer.clock() - frame[1]
                key = (timer.kind, name)
                timer.totals[key] += elapsed - frame[2]
                timer.calls[key] += 1
                if timer.stack:
                    timer.stack[-1][2] += elapsed

        setattr(owner, attr, timed)

    def reset(self) -> None:
        self.totals.clear()
        self.calls.clear()


def install(timer: PhaseTimer) -> None:
    """Wrap the engine's phases (whichever of these names the imported pagedkv has)."""
    import pagedkv.engine.llm_engine as llm_engine
    import pagedkv.model.attention as attention
    import pagedkv.model.backends.cpu_native as cpu_native
    import pagedkv.model.cascade as cascade
    import pagedkv.model.layers as layers
    import pagedkv.model.llama as llama
    import pagedkv.model.ops as ops
    import pagedkv.model.runner as runner

    timer.wrap(llm_engine.LLMEngine, "step", "host")
    timer.wrap(runner.ModelRunner, "_execute", "runner.other")
    timer.wrap(llama.LlamaForCausalLM, "forward", "forward.other")
    timer.wrap(llama.LlamaForCausalLM, "compute_logits", "logits+sample")
    timer.wrap(runner.Sampler, "__call__", "logits+sample")
    timer.wrap(layers.Linear, "forward", "linear")
    for name in ("rms_norm", "add_rms_norm", "silu_and_mul", "rope"):
        timer.wrap(ops.LayerOps, name, "elementwise")
    timer.wrap(attention.AttentionMetadata, "attend", "attn.other")
    timer.wrap(cpu_native.NativeAttentionMetadata, "attend", "attn.other")
    timer.wrap(attention, "write_kv", "attn.write_kv")
    timer.wrap(attention, "decode_attention", "attn.decode")
    timer.wrap(cpu_native.NativeAttentionMetadata, "_decode", "attn.decode")
    timer.wrap(attention, "prefill_attention", "attn.prefill")
    timer.wrap(cpu_native.NativeAttentionMetadata, "_prefill", "attn.prefill")
    timer.wrap(cpu_native.NativeAttentionMetadata, "_shared_prefix", "attn.cascade_prefix")
    timer.wrap(cpu_native, "prefix_attention", "attn.cascade_prefix")  # its name since s33
    timer.wrap(getattr(cpu_native, "PrefillCascade", None), "attend", "attn.cascade_prefix")
    for module in (attention, cascade, cpu_native):
        timer.wrap(module, "shared_prefix_attention", "attn.cascade_prefix")
        timer.wrap(module, "merge_states", "attn.merge")
    for name in ("_prefill_after", "_own_keys_attention"):
        timer.wrap(attention, name, "attn.prefill_own")
    original = runner.ModelRunner.describe_step

    def describe(self, scheduled):  # noqa: ANN001, ANN202
        timer.kind = "prefill" if any(s.num_new_tokens > 1 for s in scheduled) else "decode"
        return original(self, scheduled)

    runner.ModelRunner.describe_step = describe


def worker(spec: dict) -> None:
    """Run the workloads `spec["runs"]` times in this process; print one JSON line per run."""
    sys.path.insert(0, str(HERE))
    import torch
    from bench_offline import VS_ENGINE, WORKLOADS

    from pagedkv import LLM, SamplingParams

    cpu_clock = spec["threads"] == 1
    timer = PhaseTimer(time.thread_time if cpu_clock else time.perf_counter)
    install(timer)
    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, enable_prefix_caching=True,
              kv_cache_memory_bytes=1 << 30, cpu_kernels="wait", cpu_threads=spec["threads"],
              **VS_ENGINE)
    engine = llm.llm_engine
    for name in spec["workloads"]:  # a warm-up run of each workload
        run_once(llm, engine, WORKLOADS[name](spec["vocab"]), SamplingParams, timer)
    profile = None
    for r in range(spec["runs"]):
        for name in spec["workloads"]:
            requests = WORKLOADS[name](spec["vocab"])
            if spec.get("torch_profile") and r == 0 and name == spec["workloads"][0]:
                with torch.profiler.profile(record_shapes=True) as prof:
                    result = run_once(llm, engine, requests, SamplingParams, timer)
                profile = prof.key_averages(group_by_input_shape=True).table(
                    sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50,
                    max_shapes_column_width=60)
            else:
                result = run_once(llm, engine, requests, SamplingParams, timer)
            result["workload"] = name
            print("RESULT " + json.dumps(result), flush=True)
    if profile:
        print(profile, file=sys.stderr, flush=True)


def run_once(llm, engine, requests, sampling_params, timer: PhaseTimer) -> dict:  # noqa: ANN001
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    params = [sampling_params(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    engine.scheduler.kv_cache_manager.reset_prefix_cache()
    steps: dict[str, int] = defaultdict(int)
    original = engine.runner.execute

    def counting(out):  # noqa: ANN001, ANN202
        kind = "prefill" if any(s.num_new_tokens > 1 for s in out.scheduled) else "decode"
        steps[kind] += 1
        return original(out)

    engine.runner.execute = counting
    timer.reset()
    start, cpu_start = time.perf_counter(), time.thread_time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    if timer.clock is time.thread_time:  # one thread: the work itself, whatever the load
        seconds = time.thread_time() - cpu_start
    del engine.runner.execute
    engine.scheduler.check_invariants()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    phases = {f"{kind}:{name}": 1e3 * s for (kind, name), s in timer.totals.items()}
    return dict(seconds=seconds, tokens_per_s=tokens / seconds, steps=dict(steps),
                phases_ms=phases, tokens=[list(o.outputs[0].token_ids) for o in outputs])


def run_side(tree: Path, spec: dict) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(HERE / "bench_shared_prefix.py"), "--worker", json.dumps(spec)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode:
        raise RuntimeError(f"worker failed:\n{proc.stderr[-3000:]}")
    if spec.get("torch_profile"):
        print(proc.stderr[-12000:])
    return [json.loads(line[7:]) for line in proc.stdout.splitlines()
            if line.startswith("RESULT ")]


PHASES = ("linear", "elementwise", "attn.write_kv", "attn.decode", "attn.cascade_prefix",
          "attn.merge", "attn.prefill_own", "attn.prefill", "attn.other", "forward.other",
          "logits+sample", "runner.other", "host")


def print_breakdown(label: str, results: list[dict]) -> None:
    """Median milliseconds per run of each phase, by step kind."""
    rates = " / ".join(f"{r['tokens_per_s']:,.0f}" for r in results)
    print(f"  {label}: {rates} tok/s; steps {results[0]['steps']}")
    print(f"    {'phase':<22}{'prefill steps':>14}{'decode steps':>14}{'total':>10}  (ms per run, "
          "medians)")
    total_p = total_d = 0.0
    for phase in PHASES:
        p = statistics.median(r["phases_ms"].get(f"prefill:{phase}", 0.0) for r in results)
        d = statistics.median(r["phases_ms"].get(f"decode:{phase}", 0.0) for r in results)
        total_p, total_d = total_p + p, total_d + d
        print(f"    {phase:<22}{p:>14.1f}{d:>14.1f}{p + d:>10.1f}")
    wall = 1e3 * statistics.median(r["seconds"] for r in results)
    print(f"    {'sum of phases':<22}{total_p:>14.1f}{total_d:>14.1f}{total_p + total_d:>10.1f}"
          f"   wall {wall:.1f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--workloads", default="shared_prefix,mixed")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per workload per side")
    parser.add_argument("--rounds", type=int, default=1,
                        help="--baseline: alternating subprocess pairs per dtype")
    parser.add_argument("--baseline", default=None, metavar="GIT_REF")
    parser.add_argument("--torch-profile", action="store_true")
    parser.add_argument("--threads", type=int, default=None,
                        help="the engines' thread count (default: the thread governor's); 1: "
                             "every time is the stepping thread's CPU time (time.thread_time), "
                             "which other processes on a shared machine disturb far less")
    parser.add_argument("--model-dir", default=None, help="reuse/cache the random models here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    sys.path.insert(0, str(HERE))
    from bench_offline import SHAPE

    from pagedkv.bench.machine import cpu_name
    from pagedkv.testing.random_model import build_random_model_dir

    this_tree = HERE.parent
    clock = "thread CPU time, 1 thread" if args.threads == 1 else "wall time"
    print(f"CPU: {cpu_name()}; {clock}; load average at start {os.getloadavg()[0]:.2f}",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this": this_tree}
        if args.baseline:
            archive = subprocess.run(["git", "-C", str(this_tree), "archive", args.baseline,
                                      "pagedkv"], capture_output=True, check=True).stdout
            base_tree = Path(tmp) / "baseline"
            base_tree.mkdir()
            subprocess.run(["tar", "-x", "-C", str(base_tree)], input=archive, check=True)
            trees = {"baseline": base_tree, "this": this_tree}
        models = Path(args.model_dir or tmp)
        for dtype in args.dtypes.split(","):
            model_dir = models / f"llama-512x8-{dtype}"
            if not (model_dir / "model.safetensors").exists():
                build_random_model_dir(model_dir, dtype=dtype, seed=0, **SHAPE)
            vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
            spec = dict(model=str(model_dir), dtype=dtype, vocab=vocab, runs=args.runs,
                        threads=args.threads,
                        workloads=args.workloads.split(","))
            results: dict[str, list[dict]] = {name: [] for name in trees}
            for r in range(args.rounds):
                for name in trees if r % 2 == 0 else list(trees)[::-1]:
                    results[name] += run_side(trees[name], dict(
                        spec, torch_profile=args.torch_profile and name == "this" and r == 0))
            for workload in spec["workloads"]:
                print(f"[{dtype}] {workload}")
                medians = {}
                for name, runs in results.items():
                    mine = [x for x in runs if x["workload"] == workload]
                    print_breakdown(name, mine)
                    medians[name] = statistics.median(x["tokens_per_s"] for x in mine)
                if args.baseline:
                    a = [x for x in results["this"] if x["workload"] == workload][0]["tokens"]
                    b = [x for x in results["baseline"] if x["workload"] == workload][0]["tokens"]
                    same = sum(x == y for x, y in zip(a, b, strict=True))
                    print(f"  this / baseline: {medians['this'] / medians['baseline']:.2f}x "
                          f"(median tok/s); greedy tokens identical on {same}/{len(a)} prompts",
                          flush=True)
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
