"""The cost of structured outputs: the same decode workload with and without a grammar.

    .venv/bin/python benchmarks/bench_structured.py [--requests 32] [--tokens 48] [--reps 3] [--json]

A random-weight Llama (hidden 256, 4 layers). Constrained: `--requests` requests whose output
must match `[a-z]{--tokens}` (then eos). Baseline: the same prompts, unconstrained, each decoding
exactly as many tokens as its constrained run did (ignore_eos), so both runs do the same model
work and the grammar's per-token mask (filled on the CPU by xgrammar, applied to the batch's
logits) is the difference. Reports output tokens/s of both, their ratio, and the
one-off compile time of the grammar (cached afterwards, shown by a second compile).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

SHAPE = dict(arch="llama", hidden_size=256, intermediate_size=704, num_layers=4, num_heads=4,
             num_kv_heads=2, max_position_embeddings=2048)


def run(llm, prompts, params) -> tuple[float, int, list[int]]:
    """(seconds, output tokens, output tokens per request) of one batch."""
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    return elapsed, sum(lengths), lengths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from pagedkv import LLM, SamplingParams, StructuredOutputsParams
    from pagedkv.testing import build_random_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        build_random_model_dir(model_dir, dtype="float32", seed=0, **SHAPE)
        llm = LLM(str(model_dir), dtype="float32", seed=0, max_num_seqs=args.requests)
        rng = random.Random(0)
        prompts = [[rng.randrange(4, 500) for _ in range(32)] for _ in range(args.requests)]
        so = StructuredOutputsParams(regex=f"[a-z]{{{args.tokens}}}")
        backend = llm.llm_engine.structured_output_backend
        start = time.perf_counter()
        backend.compile(so)
        compile_s = time.perf_counter() - start
        start = time.perf_counter()
        backend.compile(so)
        cached_s = time.perf_counter() - start
        constrained = SamplingParams(temperature=1.0, seed=1, max_tokens=args.tokens + 1,
                                     structured_outputs=so)
        _, so_tokens, lengths = run(llm, prompts, constrained)  # warm-up, and the lengths
        # The baseline decodes exactly as many tokens per request, unconstrained.
        plain = [SamplingParams(temperature=1.0, seed=1, max_tokens=n, ignore_eos=True)
                 for n in lengths]
        run(llm, prompts, plain)  # warm-up
        base_times, so_times = [], []
        for _ in range(args.reps):  # interleaved, best of each: the machine's load varies
            base_times.append(run(llm, prompts, plain)[0])
            so_times.append(run(llm, prompts, constrained)[0])
        base_s, so_s, base_tokens = min(base_times), min(so_times), so_tokens
    report = {
        "baseline_tokens_per_s": base_tokens / base_s, "baseline_tokens": base_tokens,
        "structured_tokens_per_s": so_tokens / so_s, "structured_tokens": so_tokens,
        "ratio_structured_over_baseline": (so_tokens / so_s) / (base_tokens / base_s),
        "compile_s": compile_s, "cached_compile_s": cached_s,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key:34s} {value:.4g}" if isinstance(value, float) else f"{key:34s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
