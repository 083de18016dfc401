"""Tensor parallelism on CPU: N ranks (gloo, one thread each by default) against one process
with N threads (and one process with one thread: on a busy machine N threads can lose to 1), on bench_offline.py's random Llama (hidden 512, 8 layers, 8 heads, 4 KV heads)
and a slice of its mixed workload, runs alternating.

    .venv/bin/python benchmarks/bench_offline.py --tensor-parallel-size 2 [--rounds 3]
        [--requests 16] [--dtypes float32]

Prints per run: output tok/s of both, the ratio, and rank 0's time in all-reduce (2 per layer:
after attention and after the MLP), in the logits gather and in the step broadcast as a share
of the wall time of the generate call. Rank 0's all-reduce time includes waiting for the slower
rank; "least waiting rank" is the smaller of the ranks' all-reduce totals, an upper bound on
the collective's own cost (a call's cost is at most what the last rank to arrive spends in
it). Greedy tokens of both are compared.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from pagedkv.bench.machine import cpu_name


def _run(model_dir: Path, dtype: str, requests, tp: int, threads: int) -> dict:
    from pagedkv import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype=dtype, seed=0, tensor_parallel_size=tp,
              cpu_threads=threads, kv_cache_memory_bytes=1 << 30)
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    try:
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
        llm.llm_engine.scheduler.kv_cache_manager.reset_prefix_cache()
        runner = llm.llm_engine.runner
        steps = [0]
        execute = runner.execute

        def counted(out):
            steps[0] += 1
            return execute(out)

        runner.execute = counted  # an instance attribute: the engine calls it
        ranks = getattr(runner, "collective_rpc", None)
        before = ranks("collective_seconds") if ranks else []
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        after = ranks("collective_seconds") if ranks else []
        per_rank = [{k: v - b.get(k, 0.0) for k, v in a.items()}
                    for a, b in zip(after, before, strict=True)]
        spent = dict(per_rank[0]) if per_rank else {}
        if per_rank:  # the rank that arrives last waits only for the transfer itself
            spent["all-reduce (least waiting rank)"] = min(r.get("all-reduce", 0.0)
                                                           for r in per_rank)
    finally:
        llm.shutdown()
    tokens = [o.outputs[0].token_ids for o in outputs]
    return dict(seconds=elapsed, tokens_per_s=sum(map(len, tokens)) / elapsed, tokens=tokens,
                share={k: v / elapsed for k, v in spent.items()}, steps=steps[0],
                step_ms=1e3 * elapsed / max(steps[0], 1))


def run(args, base: Path, shape: dict, workload) -> dict:
    from pagedkv.testing.random_model import build_random_model_dir

    tp = args.tensor_parallel_size
    report = {"cpu": cpu_name(), "tensor_parallel_size": tp, "load_start": os.getloadavg()[0],
              "rows": []}
    for dtype in args.dtypes.split(","):
        model_dir = base / f"llama-512x8-{dtype}"
        if not (model_dir / "model.safetensors").exists():
            build_random_model_dir(model_dir, dtype=dtype, seed=0, **shape)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        requests = workload(0, vocab)[: args.requests]
        one, many, single = [], [], []
        for r in range(args.rounds):
            order = [(1, tp), (tp, 1), (1, 1)]
            for ranks, threads in order if r % 2 == 0 else order[::-1]:
                res = _run(model_dir, dtype, requests, ranks, threads)
                (many if ranks > 1 else one if threads == tp else single).append(res)
                shares = ", ".join(f"{k} {100 * v:.1f}%" for k, v in sorted(res["share"].items()))
                print(f"[{dtype}] round {r} tp={ranks} x {threads} thread(s): "
                      f"{res['tokens_per_s']:.1f} tok/s, {res['step_ms']:.1f} ms/step"
                      + (f" ({shares})" if shares else ""), flush=True)
        ratio = statistics.median(m["tokens_per_s"] for m in many) / \
            statistics.median(o["tokens_per_s"] for o in one)
        allreduce = [m["share"].get("all-reduce (least waiting rank)", 0.0) for m in many]
        same = all(m["tokens"] == one[0]["tokens"] for m in many + one + single)
        print(f"[{dtype}] tp={tp} / one process x {tp} threads: {ratio:.2f}x (median tok/s); "
              f"all-reduce (least waiting rank) {100 * min(allreduce):.1f}-"
              f"{100 * max(allreduce):.1f}% of the wall time; greedy tokens identical: {same}",
              flush=True)
        report["rows"].append(dict(
            dtype=dtype, ratio=ratio, same_tokens=same,
            one_process=[o["tokens_per_s"] for o in one],
            one_process_one_thread=[o["tokens_per_s"] for o in single],
            tensor_parallel=[m["tokens_per_s"] for m in many],
            shares=[m["share"] for m in many],
            steps=[{"steps": m["steps"], "step_ms": m["step_ms"]} for m in many]))
    cost = allreduce_cost(tp, [(8, shape["hidden_size"]), (256, shape["hidden_size"])])
    per_step = 2 * shape["num_layers"] * cost[str((8, shape["hidden_size"]))]
    for row in report["rows"]:
        step_ms = statistics.median(s["step_ms"] for s in row["steps"])
        row["allreduce_transport_share"] = 1e3 * per_step / step_ms
        print(f"[{row['dtype']}] gloo all-reduce alone: "
              + ", ".join(f"{k} {1e6 * v:.0f} us" for k, v in cost.items())
              + f"; {2 * shape['num_layers']} per step = {1e3 * per_step:.1f} ms of a "
              f"{step_ms:.1f} ms step ({100 * row['allreduce_transport_share']:.1f}%)",
              flush=True)
    report["allreduce_cost_s"] = cost
    report["load_end"] = os.getloadavg()[0]
    return report


def _allreduce_rank(rank: int, size: int, init: str, shapes: list, reps: int, out) -> None:
    import torch

    from pagedkv.model.parallel.group import TensorParallelGroup

    torch.set_num_threads(1)
    group = TensorParallelGroup.connect(init, rank, size, torch.device("cpu"), 60.0)
    times = {}
    for shape in shapes:
        t = torch.randn(shape)
        for _ in range(5):
            group.all_reduce(t)
        durations = []
        for _ in range(reps):
            start = time.perf_counter()
            group.all_reduce(t)
            durations.append(time.perf_counter() - start)
        times[str(shape)] = durations
    gathered = group.gather_objects(times)
    if rank == 0:
        out.put(gathered)
    group.close()


def allreduce_cost(size: int, shapes: list, reps: int = 300) -> dict[str, float]:
    """Median over calls of the smallest time any rank spent in one gloo all-reduce of each
    shape (the rank that arrives last waits only for the transfer): the collective's own cost,
    with scheduling waits mostly filtered out."""
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rv"
        procs = [ctx.Process(target=_allreduce_rank, args=(r, size, init, shapes, reps, out))
                 for r in range(1, size)]
        for p in procs:
            p.start()
        _allreduce_rank(0, size, init, shapes, reps, out)
        gathered = out.get(timeout=60)
        for p in procs:
            p.join(30)
    return {shape: statistics.median(min(rank[shape][i] for rank in gathered)
                                     for i in range(reps)) for shape in gathered[0]}


if __name__ == "__main__":
    for shape, seconds in allreduce_cost(2, [(1, 512), (8, 512), (256, 512)]).items():
        print(f"gloo all-reduce {shape} float32, 2 ranks: {1e6 * seconds:.0f} us (median of "
              "per-call minimum over ranks)")
