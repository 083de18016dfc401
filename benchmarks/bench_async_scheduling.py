"""Overlapped scheduling (`async_scheduling`, issue 26) against the serial loop: offline
throughput of the same engine settings with it off and on, alternating rounds in one process.

The benchmark's random-weight Llama (hidden 512, 8 layers, as bench_offline.py), `--requests`
prompts of 256 random tokens, 128 output tokens each (ignore_eos), `max_num_seqs` 16 (the
online shape of issue 26); each round runs both engines once, the order alternating. Prints the
output tok/s of every run, the medians and their ratio (on / off), and the load average: on a
shared machine only the ratio of interleaved runs means anything.

    PYTHONPATH=$PWD python benchmarks/bench_async_scheduling.py [--dtype bfloat16] [--rounds 3]
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
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--model-dir", default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_offline import SHAPE

    from pagedkv import LLM, SamplingParams
    from pagedkv.bench.machine import cpu_name
    from pagedkv.testing.random_model import build_random_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model_dir or tmp) / f"llama-512x8-{args.dtype}"
        if not (model_dir / "model.safetensors").exists():
            build_random_model_dir(model_dir, dtype=args.dtype, seed=0, **SHAPE)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        rng = random.Random(0)
        prompts = [{"prompt_token_ids": [rng.randrange(4, vocab) for _ in range(256)]}
                   for _ in range(args.requests)]
        params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
        engines = {mode: LLM(model=str(model_dir), dtype=args.dtype, seed=0, block_size=32,
                             max_num_seqs=args.max_num_seqs, kv_cache_memory_bytes=1 << 30,
                             cpu_kernels="wait", async_scheduling=mode == "on")
                   for mode in ("off", "on")}
        load_start = os.getloadavg()[0]
        runs: dict[str, list[float]] = {"off": [], "on": []}
        tokens: dict[str, list] = {}
        for r in range(args.rounds):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                llm = engines[mode]
                llm.llm_engine.scheduler.kv_cache_manager.reset_prefix_cache()
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                runs[mode].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
                tokens[mode] = [o.outputs[0].token_ids for o in outs]
        for llm in engines.values():
            llm.shutdown()
    same = sum(a == b for a, b in zip(tokens["off"], tokens["on"], strict=True))
    med = {mode: statistics.median(v) for mode, v in runs.items()}
    print(f"{cpu_name()}, {args.dtype}, {args.requests} x 256 in / 128 out, max_num_seqs "
          f"{args.max_num_seqs}; load average {load_start:.1f} -> {os.getloadavg()[0]:.1f}")
    for mode in ("off", "on"):
        print(f"async_scheduling {mode:>3}: " + " / ".join(f"{x:,.0f}" for x in runs[mode])
              + f" tok/s (median {med[mode]:,.0f})")
    print(f"on / off: {med['on'] / med['off']:.2f}x; greedy tokens identical on "
          f"{same}/{len(prompts)} prompts")


if __name__ == "__main__":
    main()
