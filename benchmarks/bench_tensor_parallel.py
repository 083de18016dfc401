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


def _run(model_dir: Path, dtype: str, requests, tp: int, threads: int) -> dict:
    from pagedkv import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype=dtype, seed=0, tensor_parallel_size=tp,
              cpu_threads=threads, kv_cache_memory_bytes=1 << 30)
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    try:
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
        llm.llm_engine.scheduler.kv_cache_manager.reset_prefix_cache()
        ranks = getattr(llm.llm_engine.runner, "collective_rpc", None)
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
                share={k: v / elapsed for k, v in spent.items()})


def run(args, base: Path, shape: dict, workload) -> dict:
    from pagedkv.testing.random_model import build_random_model_dir

    tp = args.tensor_parallel_size
    report = {"cpu": _cpu_name(), "tensor_parallel_size": tp, "load_start": os.getloadavg()[0],
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
                      f"{res['tokens_per_s']:.1f} tok/s" + (f" ({shares})" if shares else ""),
                      flush=True)
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
            shares=[m["share"] for m in many]))
    report["load_end"] = os.getloadavg()[0]
    return report


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
