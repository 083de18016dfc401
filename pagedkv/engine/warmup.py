"""The CPU warm-up at engine start (issue 26): a fresh process's first steps ran about half as
fast as the next ones (`bench_offline.py --first-run`): the first pass over each large shape
takes fresh memory from the allocator (page faults on activations of thousands of tokens) and
builds the kernels' per-shape state. The core runs one throwaway prefill step of up to
`WARMUP_TOKENS` tokens and one decode step of up to `max_num_seqs` rows through the runner,
before the first request, so the user's first `generate` runs as fast as the second.

The steps write only into device KV blocks that no request holds yet (the cache is empty at
start), sample greedily (no generator advances) and touch neither the scheduler nor the KV
manager, so nothing of them is visible afterwards but the time they took.
"""

from __future__ import annotations

import os

from pagedkv.sched.output import ScheduledRequest, SchedulerOutput
from pagedkv.sched.sampling_params import SamplingParams

# The prefill warm-up's tokens at most: the scale of a chunked-prefill step (vLLM's CPU
# default budget); larger budgets' first steps still allocate once more.
WARMUP_TOKENS = 2048
# PAGEDKV_SKIP_WARMUP=1: engines start without the warm-up (a quicker start, slower first
# steps). The test suite sets it: the warm-up leaves nothing a test could see, and its own
# tests (tests/engine/test_warmup.py) run it.
SKIP_ENV = "PAGEDKV_SKIP_WARMUP"


def warmup_skipped() -> bool:
    """Whether $PAGEDKV_SKIP_WARMUP turns the warm-up off."""
    return os.environ.get(SKIP_ENV, "") == "1"


def warmup_steps(num_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int,
                 num_blocks: int) -> list[SchedulerOutput]:
    """The warm-up's steps (a prefill, a decode, then one that drops their requests), sized to
    the budgets and to the blocks 1 .. num_blocks - 1; [] when the cache is too small."""
    usable = num_blocks - 1  # block 0 may be the null block
    num_tokens = min(num_tokens, WARMUP_TOKENS, max(usable - 1, 0) * block_size)
    if num_tokens < 1:
        return []
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    lens = [min(max_model_len - 1, num_tokens - s) for s in range(0, num_tokens, max_model_len - 1)]
    prefill, next_block = [], 1
    for i, n in enumerate(lens):
        table = list(range(next_block, next_block + -(-(n + 1) // block_size)))
        next_block += len(table)
        prefill.append(ScheduledRequest(f"warmup-{i}", [1] * n, 0, table, greedy))
    if next_block > num_blocks:  # many short sequences: their partial blocks do not fit
        return []
    rows = min(max_num_seqs, usable)
    decode = [ScheduledRequest(f"warmup-decode-{i}", [1], 0, [1 + i], greedy) for i in range(rows)]
    ids = [s.request_id for s in prefill + decode]
    return [SchedulerOutput(scheduled=prefill), SchedulerOutput(scheduled=decode),
            SchedulerOutput(finished_request_ids=ids)]
