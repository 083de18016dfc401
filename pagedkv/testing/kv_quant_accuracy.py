"""The accuracy cost of a quantized KV cache: teacher-forced logits of two runners, compared.

`teacher_forced_logits` prefills a prompt in chunks and then decodes a fixed continuation one
token at a time (the same tokens whatever the model predicts), returning the logits at every
decode position; the K/V of all but the newest token are read back from the paged cache, so two
runners that differ only in `kv_cache_dtype` differ only by the cache's rounding.
`compare_logits` gives the max absolute logit error and the greedy-token agreement (argmax equal).
`prompt_logits` is the prompt-logprob view (every position's next-token logits while the
prompt is prefilled in chunks, each chunk reading the earlier ones back from the paged cache:
the engine's prompt-logprob path, but keeping whole distributions), and `kl_divergence` the
measure llama.cpp's `--kl-divergence` reports: KL(reference || candidate) per position, its
mean and 99th percentile, and the top-1 agreement.
Used by tests/model/test_kv_quant.py and benchmarks/bench_kv_quant.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.model.logits_rows import select_logits_rows
from pagedkv.model.runner import ModelRunner
from pagedkv.sched.output import ScheduledRequest
from pagedkv.sched.sampling_params import SamplingParams


def _forward(runner: ModelRunner, request: ScheduledRequest) -> torch.Tensor:
    """Logits [vocab] (float32, CPU) at the last position of `request`'s tokens."""
    reqs, ids, pos, meta = runner.prepare_inputs([request])
    hidden = runner.model(ids, pos, runner.layer_kv_caches, meta)
    return runner.model.compute_logits(select_logits_rows(reqs).gather(hidden))[0].float().cpu()


def _request_factory(runner: ModelRunner, total: int):
    """A function (tokens, start) -> ScheduledRequest over blocks 1.. of `runner`'s cache,
    enough for `total` tokens (with KV cache groups, each group its own run of blocks).
    Raises ValueError when the cache is too small."""
    n = -(-total // runner.block_size)
    groups = 1 if runner.layer_groups is None else runner.layer_groups.num_groups
    tables = [list(range(1 + g * n, 1 + (g + 1) * n)) for g in range(groups)]
    if groups * n >= runner.kv_cache.num_blocks:
        raise ValueError(f"{total} tokens need {groups * n} blocks, the cache has "
                         f"{runner.kv_cache.num_blocks - 1}")
    params = SamplingParams(temperature=0.0)

    def request(tokens: list[int], start: int) -> ScheduledRequest:
        return ScheduledRequest("r", tokens, start, tables[0], params,
                                group_block_tables=tables if groups > 1 else None)

    return request


@torch.inference_mode()
def teacher_forced_logits(runner: ModelRunner, prompt: list[int], continuation: list[int],
                          chunk_size: int = 32) -> torch.Tensor:
    """Logits [len(continuation) + 1, vocab]: after the prompt, then after each continuation
    token. Uses blocks 1.. of `runner`'s KV cache (overwritten; with KV cache groups, each
    group its own run of blocks)."""
    request = _request_factory(runner, len(prompt) + len(continuation))
    rows = []
    for start in range(0, len(prompt), chunk_size):
        logits = _forward(runner, request(prompt[start:start + chunk_size], start))
    rows.append(logits)
    for i, token in enumerate(continuation):
        rows.append(_forward(runner, request([token], len(prompt) + i)))
    return torch.stack(rows)


@dataclass(frozen=True)
class LogitComparison:
    """How far `logits` are from `reference` ([positions, vocab] each)."""

    max_abs_error: float
    logit_range: float  # max - min of the reference logits, for scale
    greedy_agreement: float  # fraction of positions with the same argmax
    positions: int


def compare_logits(reference: torch.Tensor, logits: torch.Tensor) -> LogitComparison:
    """Max |logits - reference|, the reference's spread and the argmax agreement (`logits`
    moved to the reference's device first: a GPU run against a CPU reference)."""
    logits = logits.to(reference.device)
    same = (reference.argmax(-1) == logits.argmax(-1)).float()
    return LogitComparison(
        max_abs_error=float((logits - reference).abs().max()),
        logit_range=float(reference.max() - reference.min()),
        greedy_agreement=float(same.mean()),
        positions=reference.shape[0])


@torch.inference_mode()
def prompt_logits(runner: ModelRunner, tokens: list[int], chunk_size: int = 256) -> torch.Tensor:
    """Logits [len(tokens), vocab] (float32, CPU): row i is the next-token distribution after
    tokens[: i + 1], prefilled in chunks of `chunk_size` (a chunk attends to the earlier ones as
    the cache returns them, and to itself as the cache will). Uses blocks 1.. of `runner`'s
    KV cache (overwritten; with KV cache groups, each group its own run of blocks). Raises
    ValueError when the cache is too small."""
    request = _request_factory(runner, len(tokens))
    rows = []
    for start in range(0, len(tokens), chunk_size):
        _, ids, pos, meta = runner.prepare_inputs([request(tokens[start:start + chunk_size],
                                                           start)])
        hidden = runner.model(ids, pos, runner.layer_kv_caches, meta)
        rows.append(runner.model.compute_logits(hidden).float().cpu())
    return torch.cat(rows)


@dataclass(frozen=True)
class KLComparison:
    """KL(reference || candidate) of next-token distributions over `positions` positions."""

    mean_kl: float
    p99_kl: float
    max_kl: float
    top1_agreement: float  # fraction of positions with the same argmax
    positions: int


def kl_per_position(reference: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(reference) || softmax(logits)) per row (float64 [positions], nats)."""
    ref = reference.double().log_softmax(-1)
    got = logits.double().log_softmax(-1)
    return (ref.exp() * (ref - got)).sum(-1).clamp_(min=0.0)


def kl_divergence(references: list[torch.Tensor], candidates: list[torch.Tensor]) -> KLComparison:
    """Mean, 99th percentile and max of the per-position KL over every row of every pair of
    [positions, vocab] logits, and the top-1 (argmax) agreement."""
    kl = torch.cat([kl_per_position(r, c) for r, c in zip(references, candidates, strict=True)])
    same = torch.cat([(r.argmax(-1) == c.argmax(-1)).double()
                      for r, c in zip(references, candidates, strict=True)])
    return KLComparison(mean_kl=float(kl.mean()), p99_kl=float(torch.quantile(kl, 0.99)),
                        max_kl=float(kl.max()), top1_agreement=float(same.mean()),
                        positions=int(kl.numel()))
