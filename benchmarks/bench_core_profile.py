"""Where the engine core's time goes on CPU, by op class, per dtype: the serving shape offline.

    PYTHONPATH=$PWD python benchmarks/bench_core_profile.py [--dtypes bfloat16,float32]
        [--num-prompts 64] [--input-len 256] [--output-len 128] [--max-num-seqs 64]
        [--num-layers 8] [--kv-cache-memory 2GiB] [--baseline GIT_REF --repeat 3]

The workload of `bench_serve.py` at concurrency = max_num_seqs, in one process with the core
in-process (no HTTP, no tokenizer): bench_offline.py's SHAPE (hidden 512, 8 layers, 8 heads,
4 KV heads, intermediate 1408), `--num-prompts` random prompts of `--input-len` tokens,
`--output-len` tokens each (greedy, ignore_eos), block size 32, the default 2,048-token step
budget, so prefill chunks ride with the decodes as they do under load. Per dtype: one
untimed warm-up, one timed run (tok/s), then one run under torch.profiler whose op times are
summed by class (every op's self time goes to the nearest class found on its way up to the
step: the linears, the attention pieces, the elementwise kernels, logits, sampling, the
runner's Python, the rest of the engine's host time), in decode-only and mixed
(prefill + decode) steps. The profiler's own cost inflates the host classes: read the shares
against the untimed run's tok/s.

--baseline GIT_REF: instead, the timed run alone in child processes, GIT_REF's `pagedkv`
(extracted with `git archive`) against this tree's, alternating `--repeat` times; prints
tok/s of each and the median ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_offline import SHAPE  # noqa: E402

BLOCK_SIZE = 32
KV_BYTES = 2 << 30

# Ops by class (by name); ops of no class take the class of the record_function they run in.
OP_CLASSES = {
    "pagedkv_cpu::panel_linear": "linear",
    "mkldnn::_linear_pointwise": "linear",
    "aten::linear": "linear",
    "aten::addmm": "linear",
    "aten::mm": "linear",
    "pagedkv_cpu::paged_decode_attention": "decode attention",
    "pagedkv_cpu::write_kv_": "KV write",
    "pagedkv_cpu::rms_norm": "norms",
    "pagedkv_cpu::add_rms_norm_": "norms",
    "pagedkv_cpu::silu_and_mul": "SiLU-and-mul",
    "pagedkv_cpu::rope_": "RoPE",
    "aten::embedding": "embedding",
}
# The record_functions this script wraps around engine functions (label: class of the ops in
# them that OP_CLASSES does not name; their own Python time: "<class> (Python)").
SCOPES = {"prefill_attention": "prefill attention", "decode_attention": "decode attention",
          "logits": "logits", "sampling": "sampling", "forward": "other ops in forward",
          "execute": "runner, outside forward"}


def requests(num: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(input_len)] for _ in range(num)]


def make_llm(model_dir: Path, dtype: str, max_num_seqs: int, kv_bytes: int = KV_BYTES):
    from pagedkv import LLM

    return LLM(model=str(model_dir), dtype=dtype, seed=0, block_size=BLOCK_SIZE,
               max_num_seqs=max_num_seqs, kv_cache_memory_bytes=kv_bytes, cpu_kernels="wait")


def kv_budget(args: argparse.Namespace) -> int:
    """The KV cache budget `--kv-cache-memory` names, in bytes."""
    from pagedkv.kv.sizes import parse_size

    return parse_size(args.kv_cache_memory, name="--kv-cache-memory")


def generate(llm, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    """(seconds, output tokens) of one `generate` over `prompts`."""
    from pagedkv import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.llm_engine.scheduler.kv_cache_manager.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def _scoped(fn, label_of):
    """fn wrapped in a record_function named by `label_of(*args)` (str)."""
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(label_of(*args)):
            return fn(*args, **kwargs)
    return wrapper


def instrument(runner) -> None:
    """Wrap the runner's phases in record_functions (mutates the runner, its model and sampler,
    and the native backend's metadata class for this process)."""
    from pagedkv.model.backends import cpu_native

    model = runner.model
    model.forward = _scoped(model.forward, lambda ids, pos, caches, meta: "forward:" + (
        "mixed" if meta.prefills else "decode"))
    model.compute_logits = _scoped(model.compute_logits, lambda *_: "logits")
    sampler_cls = type(runner.sampler)  # (call syntax looks __call__ up on the class)
    sampler_cls.__call__ = _scoped(sampler_cls.__call__, lambda *_: "sampling")
    runner._execute = _scoped(runner._execute, lambda *_: "execute")
    meta_cls = cpu_native.NativeAttentionMetadata
    meta_cls._decode = _scoped(meta_cls._decode, lambda *_: "decode_attention")
    cpu_native.prefill_attention_all = _scoped(cpu_native.prefill_attention_all,
                                               lambda *_: "prefill_attention")
    meta_cls._prefill = _scoped(meta_cls._prefill, lambda *_: "prefill_attention")


def classify(events) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], dict]]:
    """({(step kind, class): self ms}, {(step kind, class): {op name: self ms}}) over the
    profiler's events (see OP_CLASSES, SCOPES)."""
    totals: dict[tuple[str, str], float] = defaultdict(float)
    ops: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    threads = {ev.thread for ev in events if ev.name == "execute"}
    for ev in events:
        if ev.thread not in threads:  # (ops inside another op's worker threads: counted there)
            continue
        kind, cls, node = "step", None, ev
        while node is not None:
            name = node.name
            if name.startswith("forward:"):
                kind = name.split(":")[1]
                cls = cls or ("other ops in forward" if node is not ev else "forward (Python)")
            elif cls is None and name in OP_CLASSES:
                cls = OP_CLASSES[name]
            elif cls is None and name in SCOPES:
                cls = SCOPES[name] + (" (Python)" if node is ev else "")
            node = node.cpu_parent
        key = (kind, cls or "engine ops outside the runner")
        totals[key] += ev.self_cpu_time_total / 1e3
        ops[key][ev.name] += ev.self_cpu_time_total / 1e3
    return totals, ops


def profile_dtype(model_dir: Path, dtype: str, args: argparse.Namespace) -> dict:
    from pagedkv.testing.random_model import tokenizer_vocab_size

    llm = make_llm(model_dir, dtype, args.max_num_seqs, kv_budget(args))
    prompts = requests(args.num_prompts, args.input_len, tokenizer_vocab_size(model_dir))
    generate(llm, prompts[: args.max_num_seqs // 4 or 1], 16)  # warm-up
    seconds, tokens = generate(llm, prompts, args.output_len)
    instrument(llm.llm_engine.runner)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        prof_seconds, _ = generate(llm, prompts, args.output_len)
    totals, ops = classify(prof.events())
    totals[("step", "engine outside ops")] = max(
        0.0, prof_seconds * 1e3 - sum(totals.values()))
    rows = linear_rows(prof.events())
    llm.shutdown()
    return dict(tok_s=tokens / seconds, seconds=seconds, prof_seconds=prof_seconds,
                totals=totals, ops=ops, linear_rows=rows)


def linear_rows(events) -> dict[int, list[float]]:
    """{rows bucket: [calls, ms]} of the linears (rows of x, rounded up to a power of two)."""
    out: dict[int, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in events:
        if OP_CLASSES.get(ev.name) == "linear" and ev.input_shapes and ev.input_shapes[0]:
            rows = ev.input_shapes[0][0]
            bucket = 1 << max(0, (rows - 1).bit_length())
            out[bucket][0] += 1
            out[bucket][1] += ev.cpu_time_total / 1e3
    return dict(sorted(out.items()))


def report(results: dict[str, dict]) -> None:
    from pagedkv.bench.machine import cpu_name

    dtypes = list(results)
    print(f"\nCPU: {cpu_name()}, {torch.get_num_threads()} threads; core time by class, ms "
          "(share of the profiled run)")
    for dtype in dtypes:
        r = results[dtype]
        print(f"  {dtype}: {r['tok_s']:.0f} out tok/s unprofiled ({r['seconds']:.2f} s), "
              f"profiled run {r['prof_seconds']:.2f} s")
    classes = sorted({key for r in results.values() for key in r["totals"]},
                     key=lambda k: -results[dtypes[0]]["totals"].get(k, 0.0))
    print(f"{'step':7} {'class':30}" + "".join(f"{d:>18}" for d in dtypes)
          + ("   ratio" if len(dtypes) == 2 else ""))
    for key in classes:
        line = f"{key[0]:7} {key[1]:30}"
        for d in dtypes:
            ms, total = results[d]["totals"].get(key, 0.0), results[d]["prof_seconds"] * 1e3
            line += f"{ms:9.0f} ({100 * ms / total:4.1f}%)"
        if len(dtypes) == 2:
            a, b = (results[d]["totals"].get(key, 0.0) for d in dtypes)
            line += f"   {a / b:5.2f}" if b else ""
        print(line)
    for d in dtypes:
        r = results[d]
        for key, ms in sorted(r["totals"].items(), key=lambda kv: -kv[1]):
            if ms >= 0.05 * r["prof_seconds"] * 1e3 and len(r["ops"].get(key, {})) > 1:
                top = sorted(r["ops"][key].items(), key=lambda kv: -kv[1])[:4]
                print(f"{d} {key[0]} {key[1]}: " + ", ".join(f"{n} {v:.0f}" for n, v in top))
        print(f"linears of {d} by rows (calls, ms): " + ", ".join(
            f"<={rows}: {c} / {ms:.0f}" for rows, (c, ms) in results[d]["linear_rows"].items()))


def timed_child(tree: str, dtype: str, args: argparse.Namespace) -> float:
    """tok/s of one timed run in a child process importing `pagedkv` from `tree`."""
    cmd = [sys.executable, __file__, "--dtypes", dtype, "--num-prompts", str(args.num_prompts),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--max-num-seqs", str(args.max_num_seqs), "--num-layers", str(args.num_layers),
           "--kv-cache-memory", args.kv_cache_memory, "--timed-only"]
    out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": tree}, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])["tok_s"]


def compare(args: argparse.Namespace) -> None:
    """Alternate timed runs of `args.baseline`'s pagedkv and this tree's; print the ratio."""
    from pagedkv.bench.baseline import baseline_tree
    from pagedkv.bench.machine import cpu_name

    here = str(Path(__file__).resolve().parents[1])
    with baseline_tree(here, args.baseline) as base:
        for dtype in args.dtypes.split(","):
            runs: dict[str, list[float]] = {"base": [], "this": []}
            for _ in range(args.repeat):
                runs["base"].append(timed_child(base, dtype, args))
                runs["this"].append(timed_child(here, dtype, args))
            ratio = statistics.median(t / b for t, b in zip(runs["this"], runs["base"],
                                                            strict=True))
            print(f"{cpu_name()} {dtype}: {args.baseline} "
                  f"{', '.join(f'{x:.0f}' for x in runs['base'])} tok/s; this tree "
                  f"{', '.join(f'{x:.0f}' for x in runs['this'])} tok/s; "
                  f"median ratio {ratio:.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--baseline", default=None, metavar="GIT_REF")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--num-layers", type=int, default=SHAPE["num_layers"],
                        help="the model's layers (a smaller model for a quick run)")
    parser.add_argument("--kv-cache-memory", default="2GiB", help="the engine's KV cache budget")
    parser.add_argument("--timed-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline:
        compare(args)
        return
    from pagedkv.testing.random_model import build_random_model_dir

    results = {}
    for dtype in args.dtypes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = build_random_model_dir(Path(tmp) / "m", dtype=dtype, seed=0,
                                               **dict(SHAPE, num_layers=args.num_layers))
            if args.timed_only:
                from pagedkv.testing.random_model import tokenizer_vocab_size

                llm = make_llm(model_dir, dtype, args.max_num_seqs, kv_budget(args))
                prompts = requests(args.num_prompts, args.input_len,
                                   tokenizer_vocab_size(model_dir))
                generate(llm, prompts[: args.max_num_seqs // 4 or 1], 16)
                seconds, tokens = generate(llm, prompts, args.output_len)
                print(json.dumps({"tok_s": tokens / seconds}))
                return
            results[dtype] = profile_dtype(model_dir, dtype, args)
    report(results)


if __name__ == "__main__":
    main()
