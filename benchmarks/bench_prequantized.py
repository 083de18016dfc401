"""GPTQ and AWQ checkpoints on CPU: pagedkv on the packed 4-bit codes against vLLM's CPU build on
the same files (its CPUWNA16 kernels), and against pagedkv on the bfloat16 checkpoint of the
same weights (the bytes a step reads), in alternating rounds.

    PYTHONPATH=$PWD python benchmarks/bench_prequantized.py [--shape qwen05b] [--layers N]
        [--group-size 128] [--threads 2] [--rounds 2] [--vs-vllm VENV/bin/python]

A random-weight Llama of `--shape` (synthetic_gguf.SHAPES' widths: Qwen2.5 0.5B's or Llama
3.2 1B's; a 49,152-token vocabulary, untied), quantized by the test writer
(pagedkv.testing.prequantized_model) into a symmetric GPTQ checkpoint (zero points 8: packed as
GGUF's Q4_0, scales alone), the same with GPTQ's act order (`desc_act`: pagedkv gathers the
activations' columns into group order before each product) and an AWQ one (zero points per
group: float32 scales and offsets), groups of `--group-size`, plus the bfloat16 checkpoint of
the weights the GPTQ codes stand for.
Each engine runs in its own process (prequantized_worker.py): decode tokens a second at batch
1 and output tokens a second of a batch (32 prompts of 256 tokens, 128 out), and the greedy
tokens (the same weights: printed as agreement). vLLM gets every core of this process and its
preloads (bench_offline.vllm_env).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from pagedkv.bench.machine import cpu_name

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_offline import engine_settings, pagedkv_env, settle, vllm_env  # noqa: E402
from synthetic_gguf import SHAPES  # noqa: E402

VOCAB = 49152
QUANTIZED = ("gptq", "gptq-act", "awq")  # the checkpoints both engines run
WORKER = Path(__file__).resolve().parent / "prequantized_worker.py"


def build_checkpoints(base: Path, shape: str, layers: int | None, group_size: int
                      ) -> dict[str, Path]:
    """{"gptq": dir, "gptq-act": dir, "awq": dir, "bfloat16": dir} under `base`."""
    from pagedkv.testing.prequantized_model import write_prequantized, write_reference
    from pagedkv.testing.random_model import build_random_model_dir

    hidden, inter, n_layers, heads, kv_heads = SHAPES[shape]
    source = build_random_model_dir(base / "float", "llama", hidden_size=hidden,
                                    intermediate_size=inter, num_layers=layers or n_layers,
                                    num_heads=heads, num_kv_heads=kv_heads, vocab_size=VOCAB,
                                    dtype="bfloat16", seed=0)
    out = {}
    reference = write_prequantized(source, base / "gptq", "gptq", group_size=group_size,
                                   sym=True)
    out["gptq"] = base / "gptq"
    out["bfloat16"] = write_reference(source, base / "bfloat16",
                                      {k: v.bfloat16() for k, v in reference.items()})
    del reference
    write_prequantized(source, base / "gptq-act", "gptq", group_size=group_size, sym=True,
                       desc_act=True)
    out["gptq-act"] = base / "gptq-act"
    write_prequantized(source, base / "awq", "awq", group_size=group_size)
    out["awq"] = base / "awq"
    return out


def run_worker(engine: str, python: str, model: Path, args: argparse.Namespace) -> dict:
    spec = {"engine": engine, "model": str(model), "dtype": "bfloat16", "threads": args.threads,
            "vocab": VOCAB, "decode_tokens": 128, "batch_prompts": 32, "batch_prompt_len": 256,
            "batch_tokens": 128}
    env = vllm_env(python, args.threads) if engine == "vllm" else pagedkv_env()
    settle()
    proc = subprocess.run([python, str(WORKER), json.dumps(spec)], env=env, capture_output=True,
                          text=True, timeout=1800)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} on {model.name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def agreement(results: dict, run_a: tuple[str, str], run_b: tuple[str, str]) -> str:
    """How far two runs' first-round greedy batch tokens agree: the mean common prefix of the
    sequences (random weights leave near-ties that round differently, after which a sequence
    goes its own way)."""
    a, b = (results[run][0]["batch_tokens"] for run in (run_a, run_b))
    def common(x: list[int], y: list[int]) -> int:
        return next((i for i, (p, q) in enumerate(zip(x, y, strict=False))
                     if p != q), min(len(x), len(y)))
    mean = statistics.mean(common(x, y) for x, y in zip(a, b, strict=True))
    return f"for {mean:.1f} of {len(a[0])} tokens on average"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen05b")
    parser.add_argument("--layers", type=int, default=None, help="override the shape's layers")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--vs-vllm", default=None, metavar="PYTHON")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"CPU: {cpu_name()}; shape {args.shape}, groups of {args.group_size}, "
          f"{args.threads} threads")
    if args.vs_vllm:
        print(engine_settings(vllm_env(args.vs_vllm, args.threads), args.threads))
    runs = [("pagedkv", c) for c in (*QUANTIZED, "bfloat16")]
    # (vLLM 0.32 refuses desc_act: "GPTQ group activation ordering (desc_act=True) is no
    # longer supported")
    runs += [("vllm", c) for c in QUANTIZED if c != "gptq-act"] if args.vs_vllm else []
    results: dict[tuple[str, str], list[dict]] = {run: [] for run in runs}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = build_checkpoints(Path(tmp), args.shape, args.layers, args.group_size)
        for r in range(args.rounds):
            for engine, ckpt in runs if r % 2 == 0 else runs[::-1]:
                python = args.vs_vllm if engine == "vllm" else sys.executable
                got = run_worker(engine, python, dirs[ckpt], args)
                results[engine, ckpt].append(got)
                print(f"  round {r} {engine:8} {ckpt:9} decode {got['decode_tok_s']:7.1f} tok/s"
                      f"  batch {got['batch_tok_s']:7.1f} tok/s", flush=True)
    med = {run: {k: statistics.median(g[k] for g in got) for k in ("decode_tok_s", "batch_tok_s")}
           for run, got in results.items()}
    print("medians over rounds (ratios of medians):")
    for ckpt in QUANTIZED:
        ours = med["pagedkv", ckpt]
        line = (f"  {ckpt}: pagedkv decode {ours['decode_tok_s']:.1f} tok/s "
                f"({ours['decode_tok_s'] / med['pagedkv', 'bfloat16']['decode_tok_s']:.2f}x its "
                f"bfloat16), batch {ours['batch_tok_s']:.1f} tok/s")
        if ("vllm", ckpt) in med:
            theirs = med["vllm", ckpt]
            line += (f"; vLLM decode {theirs['decode_tok_s']:.1f}, batch "
                     f"{theirs['batch_tok_s']:.1f}: pagedkv / vLLM decode "
                     f"{ours['decode_tok_s'] / theirs['decode_tok_s']:.2f}x, batch "
                     f"{ours['batch_tok_s'] / theirs['batch_tok_s']:.2f}x; greedy tokens the same "
                     f"{agreement(results, ('pagedkv', ckpt), ('vllm', ckpt))}")
        print(line)
    bf16 = med["pagedkv", "bfloat16"]
    print(f"  bfloat16 (the GPTQ weights): pagedkv decode {bf16['decode_tok_s']:.1f} tok/s, "
          f"batch {bf16['batch_tok_s']:.1f} tok/s; GPTQ greedy tokens the same "
          f"{agreement(results, ('pagedkv', 'gptq'), ('pagedkv', 'bfloat16'))}")


if __name__ == "__main__":
    main()
