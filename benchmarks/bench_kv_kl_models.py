"""KV cache formats on other architectures: the KL table of `bench_kv_quant.py --kl`, and a check
that the fused CPU kernels read each format in place as the pure-torch path does, on models
unlike the benchmark Llama.

    PYTHONPATH=. python benchmarks/bench_kv_kl_models.py [--models qwen2,gemma2]
        [--contexts 256,1024] [--sequences 2] [--weights float32,bfloat16] [--num-layers N]
        [--json]

Models (random weights, transformers' own checkpoints: tests/tiny_models.build_hf_model), each a
shape the benchmark Llama (GQA 2, head size 64, full attention) is not:
- qwen2: q/k/v biases, GQA 4, head size 64;
- qwen3: q/k norms, GQA 8 (one KV head), head size 128;
- mistral: every layer slides over 128 tokens, GQA 1 (as many KV heads as heads), head size 64;
- llama_hd80: GQA 4, head size 80 (not a power of two);
- gemma2: soft-capping (its own torch attention, storing and reading every format:
  model/softcap_attention.py), sliding and full layers alternating (KV cache groups), head
  size 256;
- gemma3: q/k norms, 5 sliding layers per full one, one KV head, head size 96.

Per model and weight dtype (float32, bfloat16): the reference is the float32 model with a float32
cache (exact); each candidate (the model-dtype cache: bfloat16 for float32 weights, then fp8
e4m3 with per-layer and per-head scales, e5m2 per head, int8) runs with the fused CPU kernels
(reading the quantized blocks in place) and gives, over every position of `--sequences`
pseudo-random sequences per context, the mean / p99 KL against the reference, the top-1
agreement and the mean KL over the model-dtype cache's (`x bf16`: the yardstick). The kernel
check: the same runner with the pure-torch path (dequantize, then attend), teacher-forced over
the last 16 tokens of the longest context (decode steps, the decode kernel), max |logit
difference| over the logits' spread. A NaN, the engine refusing a combination (a ValueError)
or any other exception is a failure row, and the exit status 1; so is a registered
architecture (pagedkv.model.registry) that no model here covers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from kv_kl import sequences  # noqa: E402

from pagedkv.model.registry import supported_architectures  # noqa: E402
from pagedkv.model.runner import ModelRunner  # noqa: E402
from pagedkv.testing.kv_quant_accuracy import (  # noqa: E402
    kl_divergence,
    prompt_logits,
    teacher_forced_logits,
)
from pagedkv.testing.random_model import hf_architecture  # noqa: E402
from pagedkv.utils import freeze_gc_heap  # noqa: E402
from tests.tiny_models import build_hf_model  # noqa: E402

BLOCK_SIZE = 16
DECODE_TOKENS = 16
WINDOW = 128
MODELS: dict[str, tuple[str, dict]] = {
    "qwen2": ("qwen2", dict(hidden_size=512, intermediate_size=1024, num_layers=4,
                            num_heads=8, num_kv_heads=2, head_dim=64)),
    "qwen3": ("qwen3", dict(hidden_size=512, intermediate_size=1024, num_layers=4,
                            num_heads=8, num_kv_heads=1, head_dim=128)),
    "mistral": ("mistral", dict(hidden_size=256, intermediate_size=768, num_layers=4,
                                num_heads=4, num_kv_heads=4, head_dim=64,
                                sliding_window=WINDOW)),
    "llama_hd80": ("llama", dict(hidden_size=512, intermediate_size=1024, num_layers=4,
                                 num_heads=8, num_kv_heads=2, head_dim=80)),
    "gemma2": ("gemma2", dict(hidden_size=512, intermediate_size=1024, num_layers=4,
                              num_heads=4, num_kv_heads=2, head_dim=256,
                              sliding_window=WINDOW, tie_word_embeddings=True)),
    "gemma3": ("gemma3_text", dict(hidden_size=384, intermediate_size=768, num_layers=6,
                                   num_heads=4, num_kv_heads=1, head_dim=96,
                                   sliding_window=WINDOW, tie_word_embeddings=True)),
}
QUANTIZED = ("fp8_e4m3/per_layer", "fp8_e4m3", "fp8_e5m2", "int8")


def uncovered_architectures() -> list[str]:
    """The registry's architectures that no entry of MODELS builds (should be none)."""
    covered = {hf_architecture(arch) for arch, _ in MODELS.values()}
    return [a for a in supported_architectures() if a not in covered]


def make_runner(model_dir: Path, dtype: str, cache: str, tokens: int, kernels: str
                ) -> ModelRunner:
    """A CPU runner of `dtype` weights and `cache` ("name[/per_layer]") blocks, room for
    `tokens` tokens in each KV cache group; `kernels` as ModelRunner's."""
    name, _, scales = cache.partition("/")
    runner = ModelRunner(model_dir, block_size=BLOCK_SIZE, num_blocks=None, device="cpu",
                         dtype=dtype, kv_cache_dtype=name, cpu_kernels=kernels,
                         fp8_scales=scales or "per_head")
    groups = 1 if runner.layer_groups is None else runner.layer_groups.num_groups
    runner.allocate_kv_cache(groups * -(-tokens // BLOCK_SIZE) + 1)
    runner._use_cpu_kernels()  # the fused kernels from the first step when asked for
    return runner


def logits_of(model_dir: Path, dtype: str, cache: str, seqs: list[list[int]], kernels: str
              ) -> list[torch.Tensor]:
    """Every sequence's prompt logits (prefilled in 256-token chunks) with one runner."""
    runner = make_runner(model_dir, dtype, cache, max(map(len, seqs)), kernels)
    out = [prompt_logits(runner, s, 256) for s in seqs]
    runner.shutdown()
    return out


def decode_logits(model_dir: Path, dtype: str, cache: str, seq: list[int], kernels: str
                  ) -> torch.Tensor:
    """Teacher-forced logits over the last DECODE_TOKENS tokens of `seq` (decode steps)."""
    runner = make_runner(model_dir, dtype, cache, len(seq), kernels)
    out = teacher_forced_logits(runner, seq[:-DECODE_TOKENS], seq[-DECODE_TOKENS:])
    runner.shutdown()
    return out


def kernel_gap(model_dir: Path, dtype: str, cache: str, seq: list[int]) -> float:
    """max |fused - pure torch| decode logits over the pure-torch logits' spread (NaN: a NaN)."""
    fused = decode_logits(model_dir, dtype, cache, seq, "wait")
    torch_path = decode_logits(model_dir, dtype, cache, seq, "off")
    if not (fused.isfinite().all() and torch_path.isfinite().all()):
        return math.nan
    spread = float(torch_path.max() - torch_path.min())
    return float((fused - torch_path).abs().max()) / spread


def model_rows(name: str, model_dir: Path, weights: str, contexts: list[int], num_seqs: int,
               vocab: int) -> list[dict]:
    """One row per (context, cache format) of model `name` in `weights`."""
    own = "bfloat16" if weights == "float32" else "auto"
    rows = []
    for length in contexts:
        seqs = sequences(num_seqs, length, vocab)
        ref = logits_of(model_dir, "float32", "float32", seqs, "off")
        yardstick = None
        for cache in (own, *QUANTIZED):
            row = dict(model=name, weights=weights, context=length,
                       cache=weights if cache == "auto" else cache)
            try:
                got = logits_of(model_dir, weights, cache, seqs, "wait")
                if not all(g.isfinite().all() for g in got):
                    raise ValueError("non-finite logits")
                kl = kl_divergence(ref, got)
                yardstick = yardstick or kl.mean_kl
                row.update(mean_kl=kl.mean_kl, p99_kl=kl.p99_kl, top1=kl.top1_agreement,
                           x_bf16=kl.mean_kl / yardstick, positions=kl.positions)
                if length == max(contexts):
                    row["kernel_gap"] = kernel_gap(model_dir, weights, cache, seqs[0])
            except ValueError as exc:  # the engine refuses the combination, by name
                row["refused"] = str(exc)
            except Exception as exc:  # a failure is a row of the report, not the end of it
                row["error"] = f"{type(exc).__name__}: {exc}"
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


def format_row(row: dict) -> str:
    """One line of the table."""
    head = f"{row['model']:>10} {row['weights']:>8} {row['context']:>5} {row['cache']:>18}"
    if "error" in row:
        return f"{head}  FAILED {row['error']}"
    if "refused" in row:
        return f"{head}  refused: {row['refused']}"
    gap = f"  kernel gap {row['kernel_gap']:.1e}" if "kernel_gap" in row else ""
    return (f"{head}  mean KL {row['mean_kl']:.3e}  p99 {row['p99_kl']:.3e}  "
            f"top-1 {100 * row['top1']:6.2f}%  {row['x_bf16']:5.2f}x bf16{gap}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--contexts", default="256,1024")
    parser.add_argument("--sequences", type=int, default=2)
    parser.add_argument("--weights", default="float32,bfloat16")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="every model with this many layers (default: each model's own)")
    parser.add_argument("--json", action="store_true", help="print one JSON list at the end")
    args = parser.parse_args(argv)
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {sorted(MODELS)}")
    contexts = [int(c) for c in args.contexts.split(",")]
    freeze_gc_heap()  # each runner's shutdown collects: over the imports (transformers), slowly
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            arch, shape = MODELS[name]
            if args.num_layers is not None:
                shape = dict(shape, num_layers=args.num_layers)
            model_dir = build_hf_model(Path(tmp) / name, arch, init_std=0.02,
                                       max_position_embeddings=max(contexts) + 64, **shape)
            vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
            for weights in args.weights.split(","):
                rows += model_rows(name, model_dir, weights, contexts, args.sequences, vocab)
    if args.json:
        print(json.dumps(rows, indent=2))
    uncovered = uncovered_architectures()
    if uncovered:
        print(f"registered architectures not covered: {', '.join(uncovered)}", flush=True)
    failed = [r for r in rows if "error" in r or "refused" in r
              or math.isnan(r.get("kernel_gap", 0.0))]
    return 1 if failed or uncovered else 0


if __name__ == "__main__":
    sys.exit(main())
