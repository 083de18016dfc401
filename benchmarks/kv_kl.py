"""KV cache quality by KL divergence (`bench_kv_quant.py --kl`): how far each cache format moves
the model's next-token distributions, teacher-forced on the same token sequences.

For each weight dtype (float32, bfloat16) of the benchmark model (bench_offline.py's shape:
hidden 512, 8 layers, 8 heads, 4 KV heads of 64), the reference is the same weights computing
in float32 with a float32 cache (exact: nothing rounds the K/V). Each candidate runs the model in
the weight dtype with one cache format; per position, KL(reference || candidate) of the
next-token distributions (pagedkv.testing.kv_quant_accuracy.prompt_logits: the prompt-logprob
view of a chunked prefill, every chunk reading the earlier ones back from the paged cache, whole
distributions kept), its mean and p99 over positions, and the top-1 agreement. Rows:
- float32 weights: the bfloat16 cache (the yardstick: the rounding everyone accepts), fp8
  (e4m3, e5m2; per-layer and per-head scales), int8;
- bfloat16 weights: the model-dtype (bfloat16) cache, whose KL is the bfloat16 compute's own,
  and the same quantized formats; `vs_model_cache` is each one's KL against that bfloat16 cache
  (the cache's own share).
Short and long contexts (the error grows with context). Each row's `vs_yardstick` is its mean
KL over the first row's (the bfloat16 cache of the float32 model, the bfloat16 model's own).

Why int8 sits where it does (`kv_rounding_errors`): the squared error of each format's round trip
on the very K/V the float32-exact reference wrote (mean over elements, relative to their mean
square), int8's over the bfloat16 cache's, next to the same ratio on Gaussian vectors of the head
size. KL is second order in a small logit error, so the KL ratio follows the squared-error ratio.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch

from pagedkv.model.kv_int8 import round_trip_per_token
from pagedkv.model.runner import ModelRunner
from pagedkv.testing.kv_quant_accuracy import kl_divergence, prompt_logits

BLOCK_SIZE = 16
# "/per_layer": one fp8 scale per layer (the earlier scheme); plain fp8 names have per-head scales.
QUANTIZED = ("fp8_e4m3/per_layer", "fp8_e4m3", "fp8_e5m2/per_layer", "fp8_e5m2", "int8")


def formats_for(weight_dtype: str) -> list[str]:
    """The cache formats compared for a model computing in `weight_dtype`: its own cache
    ("auto"), the bfloat16 cache for a float32 model, and every quantized one."""
    own = ["bfloat16"] if weight_dtype == "float32" else ["auto"]
    return [*own, *QUANTIZED]


def sequences(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`num` fixed pseudo-random token sequences of `length` tokens."""
    rng = random.Random(seed * 7919 + length)
    return [[rng.randrange(4, vocab) for _ in range(length)] for _ in range(num)]


def text_windows(tokens: list[int], num: int, length: int) -> list[list[int]]:
    """`num` windows of `length` tokens of `tokens` (a tokenized text), spread evenly from its
    start to its end (one window: the start). Raises ValueError when the text is shorter."""
    if len(tokens) < length:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than the context {length}")
    last = len(tokens) - length
    starts = [0] if num == 1 else [round(i * last / (num - 1)) for i in range(num)]
    return [tokens[s:s + length] for s in starts]


def runner_logits(model_dir: Path, dtype: str, cache_dtype: str, seqs: list[list[int]],
                  chunk: int, kernels: str = "off") -> list[torch.Tensor]:
    """Every sequence's prompt logits with a runner of `dtype` weights and `cache_dtype` cache;
    `kernels` "off": the pure-torch path (the numbers do not depend on whether the C++ kernels
    are built), "wait": the fused C++ kernels (an int8 or fp8 cache read in place)."""
    blocks = -(-max(len(s) for s in seqs) // BLOCK_SIZE) + 1
    name, _, scales = cache_dtype.partition("/")
    runner = ModelRunner(model_dir, block_size=BLOCK_SIZE, num_blocks=blocks, device="cpu",
                         dtype=dtype, kv_cache_dtype=name, cpu_kernels=kernels,
                         fp8_scales=scales or "per_head")
    runner._use_cpu_kernels()  # the fused kernels from the first step when asked for
    out = [prompt_logits(runner, s, chunk) for s in seqs]
    runner.shutdown()
    return out


def exact_kv(model_dir: Path, seq: list[int], chunk: int) -> torch.Tensor:
    """The K/V [layers, 2, kv_heads, len(seq), head_dim] (float32) that the float32-exact
    reference writes to its cache for `seq`."""
    blocks = -(-len(seq) // BLOCK_SIZE)
    runner = ModelRunner(model_dir, block_size=BLOCK_SIZE, num_blocks=blocks + 1, device="cpu",
                         dtype="float32", kv_cache_dtype="float32", cpu_kernels="off")
    prompt_logits(runner, seq, chunk)
    kv = runner.kv_cache.kv[:, :, :, 1:blocks + 1]
    kv = kv.reshape(*kv.shape[:3], blocks * BLOCK_SIZE, kv.shape[-1])[:, :, :, :len(seq)].clone()
    runner.shutdown()
    return kv


def relative_sq_error(x: torch.Tensor, round_trip) -> float:
    """mean((round_trip(x) - x)^2) / mean(x^2) over every element of `x`."""
    return float((round_trip(x) - x).pow(2).mean() / x.pow(2).mean())


def kv_rounding_errors(kv: torch.Tensor, seed: int = 0) -> dict[str, float]:
    """int8's squared round-trip error over the bfloat16 cache's on the keys and the values of
    `kv` ([layers, 2, kv_heads, tokens, head_dim], float32), and on as many Gaussian vectors;
    the keys' again with each channel (of each layer and head) divided by its power-of-two
    peak before the round trip (what per-channel key scales would buy: a trained model's keys
    have a few channels far above the rest, which per-token int8 steps by), and the key
    channels' peak over their median, per layer and head (mean)."""
    def bf16(x: torch.Tensor) -> torch.Tensor:
        return x.bfloat16().float()

    def ratio(x: torch.Tensor) -> float:
        return relative_sq_error(x, round_trip_per_token) / relative_sq_error(x, bf16)

    def smoothed(x: torch.Tensor) -> torch.Tensor:  # each channel over its power-of-two peak
        peak = x.abs().amax(dim=-2, keepdim=True).clamp(min=torch.finfo(x.dtype).tiny)
        s = torch.exp2(torch.round(torch.log2(peak)))
        return round_trip_per_token(x / s) * s

    keys = kv[:, 0]
    gauss = torch.randn(keys.shape, generator=torch.Generator().manual_seed(seed))
    floor = rate_distortion_floor(kv.shape[-1], relative_sq_error(gauss, bf16))
    peaks = keys.abs().amax(dim=-2)  # [layers, kv_heads, head_dim]
    return dict(keys=ratio(keys), values=ratio(kv[:, 1]), gaussian=ratio(gauss),
                keys_channel_smoothed=relative_sq_error(keys, smoothed)
                / relative_sq_error(keys, bf16),
                key_channel_peak_over_median=float((peaks.amax(-1)
                                                    / peaks.median(-1).values).mean()),
                **floor)


def rate_distortion_floor(head_dim: int, bf16_sq_error: float) -> dict[str, float]:
    """The least squared error ANY code can reach on Gaussian vectors (Shannon's distortion-rate
    function D(R) = 2^(-2R) of the variance, R bits per element, vector quantizers included)
    at int8's rate, 8 bits per element plus its float32 scale per token and KV head
    (32 / head_dim bits), over the bfloat16 cache's `bf16_sq_error` (relative, on the same
    vectors); that rate; and the rate "within 2x of bfloat16" would need. Above 1: no format spending
    int8's bits per element, however it rounds or scales, matches bfloat16's error."""
    rate = 8 + 32 / head_dim
    return dict(rate=rate, floor=2.0 ** (-2 * rate) / bf16_sq_error,
                rate_for_2x=0.5 * math.log2(1 / (2 * bf16_sq_error)))


def kl_table(model_dir: Path, weight_dtype: str, contexts: list[int], num_seqs: int,
             vocab: int, chunk: int = 256, only: list[str] | None = None,
             kernels: str = "off", seed: int = 0, text: list[int] | None = None) -> list[dict]:
    """One row per (context, format): mean / p99 / max KL against the float32-exact cache, top-1
    agreement, and (bfloat16 weights) the KL against the model-dtype cache. `only`: just these
    formats (the yardstick, the first of `formats_for`, still runs). `kernels`: the
    candidates' CPU path (runner_logits); the reference is always the pure-torch one. `seed`:
    which set of token sequences (`sequences`); `text`: windows of this tokenized text instead
    (`text_windows`)."""
    rows = []
    for length in contexts:
        seqs = sequences(num_seqs, length, vocab, seed) if text is None \
            else text_windows(text, num_seqs, length)
        ref = runner_logits(model_dir, "float32", "float32", seqs, chunk)
        errors = kv_rounding_errors(exact_kv(model_dir, seqs[0], chunk))
        print(f"[{weight_dtype} weights, {length} tokens] squared round-trip error, int8 / "
              f"bfloat16 cache, on the exact K/V: keys {errors['keys']:.1f}x, values "
              f"{errors['values']:.1f}x (Gaussian vectors: {errors['gaussian']:.1f}x; keys with "
              f"each channel divided by its power-of-two peak first: "
              f"{errors['keys_channel_smoothed']:.1f}x; key channels' peak over median, per "
              f"head: {errors['key_channel_peak_over_median']:.1f}x); any code "
              f"at int8's {errors['rate']:.2f} bits per element: >= "
              f"{errors['floor']:.2f}x on Gaussian vectors (2x needs {errors['rate_for_2x']:.2f} "
              "bits)", flush=True)
        own = yardstick = None
        for fmt in formats_for(weight_dtype):
            if only is not None and fmt not in only and fmt != formats_for(weight_dtype)[0]:
                continue
            got = runner_logits(model_dir, weight_dtype, fmt, seqs, chunk, kernels)
            if fmt == "auto":
                own = got
            kl = kl_divergence(ref, got)
            row = dict(weights=weight_dtype, context=length, kernels=kernels, seed=seed,
                       cache=weight_dtype if fmt == "auto" else fmt, mean_kl=kl.mean_kl,
                       p99_kl=kl.p99_kl, max_kl=kl.max_kl, top1=kl.top1_agreement,
                       positions=kl.positions)
            if own is not None and fmt != "auto":
                row["vs_model_cache_mean_kl"] = kl_divergence(own, got).mean_kl
            yardstick = yardstick or kl.mean_kl
            row["vs_yardstick"] = kl.mean_kl / yardstick if yardstick else float("nan")
            if fmt == "int8":
                row["int8_over_bf16_sq_error"] = errors
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


def format_row(row: dict) -> str:
    """One line of the KL table."""
    extra = (f"  (vs {row['weights']} cache: {row['vs_model_cache_mean_kl']:.3e})"
             if "vs_model_cache_mean_kl" in row else "")
    return (f"[{row['weights']} weights, {row['context']} tokens, kernels {row['kernels']}] "
            f"{row['cache']:>18} cache: "
            f"mean KL {row['mean_kl']:.3e}, p99 {row['p99_kl']:.3e}, max {row['max_kl']:.3e}, "
            f"top-1 {100 * row['top1']:.2f}% of {row['positions']}, "
            f"{row['vs_yardstick']:.2f}x the first row{extra}")


def seed_spread(rows: list[dict]) -> list[str]:
    """Per (weights, context, cache) over kl_table's rows of several sequence sets: the mean KL
    over the yardstick's pooled (mean over the sets of each, divided) and the least and greatest
    single set's ratio: whether one set's ratio is typical."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["weights"], row["context"], row["cache"]), []).append(row)
    lines = []
    for (weights, context, cache), group in groups.items():
        ratios = [r["vs_yardstick"] for r in group]
        yardstick = sum(r["mean_kl"] / r["vs_yardstick"] for r in group)
        pooled = sum(r["mean_kl"] for r in group) / yardstick
        lines.append(f"[{weights} weights, {context} tokens] {cache:>18} cache over "
                     f"{len(group)} sequence sets: pooled {pooled:.2f}x the first row, single "
                     f"sets {min(ratios):.2f}x .. {max(ratios):.2f}x (mean {sum(ratios) / len(ratios):.2f}x)")
    return lines
