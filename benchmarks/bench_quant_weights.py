"""Decode and prefill tokens/s of a GGUF model with its weights kept packed against the same file
dequantized (bfloat16 and float32), as llama-bench measures them: `tg` tokens generated one at a
time at batch 1, and a `pp`-token prompt prefilled in one step.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_quant_weights.py [MODEL.gguf]
        [--pp 512] [--tg 128] [--reps 3] [--threads N]
        [--configs auto:bfloat16,none:bfloat16,none:float32]
        [--against BASELINE_TREE --rounds 3]

MODEL defaults to the real model (SmolLM2-135M-Instruct Q4_1, pagedkv.testing.real_model).
Each configuration is one engine (`LLM`, prefix caching off, the fused CPU kernels built first);
a figure is the best of `--reps` runs (a shared machine interrupts some); with `--threads 1`
times are the process's CPU time (robust to other processes on the core). Prints tokens/s, each
configuration's ratio to the first, the weight bytes, the CPU and the load average before and
after, and each configuration's decode bandwidth floor: the bytes a decode step reads (its
weights, less the embedding table where a packed head stands in for it, plus the KV cache at
the mean context) over the measured read bandwidth (`read_bandwidth`: a sum over 1 GiB), and
the measured step time's ratio to it.

With `--against` (another checkout of pagedkv, e.g. `git archive BASE | tar -x -C /tmp/base`)
each configuration runs in child processes, this tree's and the baseline's alternating for
`--rounds` rounds (a shared machine's load hits both alike), and prints per round both decode
and prefill rates, their ratio (this tree over the baseline) and the load average.

From Python (e.g. a comparison with llama.cpp):

    from benchmarks.bench_quant_weights import pagedkv_throughput
    t = pagedkv_throughput("model.gguf", quantization="auto", dtype="bfloat16",
                           n_prompt=512, n_gen=128, threads=2)
    t.prefill_tps, t.decode_tps, t.weights_bytes
"""

from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import dataclass

from pagedkv import LLM, SamplingParams
from pagedkv.bench.machine import cpu_name


@dataclass(frozen=True)
class Throughput:
    """One configuration's figures: prompt tokens/s of a `n_prompt`-token prefill, tokens/s of
    `n_gen` greedy decode steps at batch 1, and the engine's weight bytes."""

    quantization: str
    dtype: str
    n_prompt: int
    n_gen: int
    prefill_tps: float
    decode_tps: float
    weights_bytes: int
    step_bytes: int = 0  # what a decode step reads: weights (see decode_step_bytes) and KV


def _timed(llm: LLM, tokens: list[int], max_tokens: int, clock=time.perf_counter) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = clock()
    out = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
    elapsed = clock() - start
    assert len(out[0].outputs[0].token_ids) == max_tokens
    return elapsed


def pagedkv_throughput(model: str, *, quantization: str = "auto", dtype: str = "bfloat16",
                       n_prompt: int = 512, n_gen: int = 128, threads: int | None = None,
                       reps: int = 3, seed: int = 0, depth: int = 0) -> Throughput:
    """pagedkv's prefill and batch-1 decode tokens/s on `model` (llama-bench's pp`n_prompt` and
    tg`n_gen`: random prompt tokens, generation ignoring EOS), best of `reps` runs each.
    Prefill: one `n_prompt`-token prompt computed in one step, to its first token. Decode:
    (`n_gen` - 1) tokens over the time a one-token prompt (`depth` > 0: a `depth`-token one,
    llama-bench's `-d`) takes to `n_gen` tokens less its time to the first. `threads`: torch's compute threads (None: the cores other processes leave
    free); with 1, times are this process's CPU time (time.process_time: the engine runs in
    this process), which leaves out the time other processes held the core."""
    llm = LLM(model, dtype=dtype, quantization=quantization, enable_prefix_caching=False,
              max_model_len=max(n_prompt, depth) + n_gen + 16,
              max_num_batched_tokens=max(n_prompt, depth, 256),
              max_num_seqs=1, cpu_kernels="wait", cpu_threads=threads, seed=seed)
    try:
        rng = random.Random(seed)
        vocab = llm.llm_engine.vocab_size
        prompt = [rng.randrange(100, vocab) for _ in range(n_prompt)]
        start = [rng.randrange(100, vocab) for _ in range(max(depth, 1))]
        clock = time.process_time if threads == 1 else time.perf_counter
        _timed(llm, prompt[:64], 4)  # warm-up: first calls, kernel choices
        prefill = min(_timed(llm, prompt, 1, clock) for _ in range(reps))
        first = min(_timed(llm, start, 1, clock) for _ in range(reps))
        full = min(_timed(llm, start, n_gen, clock) for _ in range(reps))
        ready = llm.llm_engine.client.ready
        weights = ready.weights_bytes
        step = decode_step_bytes(model, quantization, weights,
                                 ready.block_bytes // ready.block_size,
                                 len(start) + n_gen // 2)
    finally:
        llm.shutdown()
    return Throughput(quantization, dtype, n_prompt, n_gen, n_prompt / prefill,
                      (n_gen - 1) / max(full - first, 1e-9), weights, step)


def decode_step_bytes(model: str, quantization: str, weights_bytes: int, kv_bytes_per_token: int,
                      context: int) -> int:
    """Bytes one batch-1 decode step reads: the weights less the dense embedding table where
    the quantized model's LM head is a packed copy of it (a step reads one row of the table and
    the whole copy; a table the file keeps packed is the head's own codes, read once), plus the
    KV cache of `context` tokens."""
    if quantization != "none" and not _packed_embeddings(model):
        from pagedkv.model.loader import load_hf_config

        config = load_hf_config(model)
        if config.get("tie_word_embeddings", True):
            weights_bytes -= 2 * config["vocab_size"] * config["hidden_size"]
    return weights_bytes + kv_bytes_per_token * context


def _packed_embeddings(model: str) -> bool:
    """Whether `model` is a GGUF file whose token embedding table stays packed (int8 codes,
    shared with a tied LM head: int8_gguf.py)."""
    from pagedkv.model.gguf import gguf_file

    path = gguf_file(model)
    if path is None:
        return False
    from gguf import GGUFReader

    from pagedkv.model.quant.int8_blocks import INT8_BLOCK_TYPES

    return any(t.name == "token_embd.weight" and t.tensor_type in INT8_BLOCK_TYPES
               for t in GGUFReader(path).tensors)


def read_bandwidth(threads: int | None, gib: float = 1.0, reps: int = 3) -> float:
    """Bytes/s of a float32 sum over `gib` GiB with `threads` torch threads, best of `reps`
    (with one thread, over this thread's CPU time, as `pagedkv_throughput` times decode)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    x = torch.ones(int(gib * 2**28))
    clock = time.thread_time if threads == 1 else time.perf_counter  # as the decode timing
    best = float("inf")
    for _ in range(reps):
        start = clock()
        x.sum()
        best = min(best, clock() - start)
    return x.numel() * 4 / best


_CHILD = """
import json, sys
from bench_quant_weights import pagedkv_throughput
t = pagedkv_throughput(*sys.argv[1:2], quantization=sys.argv[2], dtype=sys.argv[3],
                       n_prompt=int(sys.argv[4]), n_gen=int(sys.argv[5]),
                       threads=int(sys.argv[6]) or None, reps=int(sys.argv[7]))
print(json.dumps([t.prefill_tps, t.decode_tps]))
"""


def _child_run(tree: str, model: str, config: str, args: argparse.Namespace) -> list[float]:
    """[prefill, decode] tokens/s of `config` with the pagedkv of checkout `tree`."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(tree).resolve()
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{root / 'benchmarks'}")
    quantization, dtype = config.split(":")
    out = subprocess.run([sys.executable, "-c", _CHILD, model, quantization, dtype,
                          str(args.pp), str(args.tg), str(args.threads or 0), str(args.reps)],
                         env=env, check=True, capture_output=True, text=True, cwd=root)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare_trees(model: str, args: argparse.Namespace) -> None:
    """Each configuration in child processes, this tree and `args.against` alternating."""
    from pathlib import Path

    here = str(Path(__file__).resolve().parents[1])
    for config in args.configs.split(","):
        for round_ in range(args.rounds):
            new = _child_run(here, model, config, args)
            base = _child_run(args.against, model, config, args)
            print(f"{config} round {round_}: tg{args.tg} {new[1]:7.1f} vs baseline "
                  f"{base[1]:7.1f} tok/s (x{new[1] / base[1]:.3f}); pp{args.pp} "
                  f"{new[0]:8.1f} vs {base[0]:8.1f} (x{new[0] / base[0]:.3f}); load average "
                  f"{os.getloadavg()[0]:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--pp", type=int, default=512)
    parser.add_argument("--tg", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--configs", default="auto:bfloat16,none:bfloat16,none:float32")
    parser.add_argument("--against", default=None, metavar="BASELINE_TREE")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from pagedkv.testing.real_model import smollm2_gguf_path

        model = str(smollm2_gguf_path())
    print(f"{model}\n{cpu_name()}, {os.cpu_count()} CPUs; load average {os.getloadavg()}")
    if args.against:
        compare_trees(model, args)
        return
    bandwidth = read_bandwidth(args.threads)
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s ({args.threads or 'default'} threads)")
    results = []
    for config in args.configs.split(","):
        quantization, dtype = config.split(":")
        t = pagedkv_throughput(model, quantization=quantization, dtype=dtype, n_prompt=args.pp,
                               n_gen=args.tg, threads=args.threads, reps=args.reps)
        results.append(t)
        print(f"quantization={quantization:5s} dtype={dtype:9s} weights "
              f"{t.weights_bytes / 2**20:6.1f} MiB: pp{args.pp} {t.prefill_tps:8.1f} tok/s, "
              f"tg{args.tg} {t.decode_tps:7.1f} tok/s; decode floor "
              f"{t.step_bytes / bandwidth * 1e3:.2f} ms/step ({t.step_bytes / 2**20:.1f} MiB), "
              f"measured x{bandwidth / t.step_bytes / t.decode_tps:.2f} of it", flush=True)
    base = results[0]
    for t in results[1:]:
        print(f"{base.quantization}:{base.dtype} over {t.quantization}:{t.dtype}: prefill "
              f"x{base.prefill_tps / t.prefill_tps:.2f}, decode x{base.decode_tps / t.decode_tps:.2f}")
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
