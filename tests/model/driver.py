"""A minimal stand-in for the scheduler: drives a ModelRunner with hand-built SchedulerOutputs.

Blocks are handed out sequentially from 1 (0 is the null block) and never reused.
"""

from __future__ import annotations

import torch

from pagedkv.model.logits_rows import select_logits_rows
from pagedkv.model.runner import ModelRunner
from pagedkv.sched.output import ScheduledRequest, SchedulerOutput
from pagedkv.sched.sampling_params import SamplingParams

# Where the tests run the CUDA backend's Triton kernels: the GPU where there is one, else CPU
# tensors under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU).
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class BlockAllocator:
    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.block_size, self.num_blocks, self.next = block_size, num_blocks, 1

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Append blocks to `table` until it holds `num_tokens` tokens."""
        while len(table) * self.block_size < num_tokens:
            if self.next >= self.num_blocks:
                raise RuntimeError("test allocator out of blocks")
            table.append(self.next)
            self.next += 1


def num_kv_groups(runner: ModelRunner) -> int:
    """KV cache groups of the runner's cache (a model mixing attention types has several, each
    with its own block table per request)."""
    return 1 if runner.layer_groups is None else runner.layer_groups.num_groups


def greedy_generate(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int,
                    chunk_size: int | None = None,
                    params: SamplingParams | None = None) -> list[list[int]]:
    """Generate for every prompt at once (continuous batching, one step per token); prefills
    are split into chunks of `chunk_size` tokens when given."""
    params = params or SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    alloc = BlockAllocator(runner.block_size, runner.kv_cache.num_blocks)
    num_groups = num_kv_groups(runner)
    tables: list[list[list[int]]] = [[[] for _ in range(num_groups)] for _ in prompts]
    computed = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    while any(len(o) < max_new_tokens for o in outputs):
        scheduled = []
        for i, prompt in enumerate(prompts):
            if len(outputs[i]) >= max_new_tokens:
                continue
            tokens = prompt + outputs[i]
            todo = tokens[computed[i]:]
            if chunk_size is not None:
                todo = todo[:chunk_size]
            end = computed[i] + len(todo)
            for table in tables[i]:
                alloc.grow(table, end)
            scheduled.append(ScheduledRequest(
                request_id=f"r{i}", token_ids=todo, start_pos=computed[i],
                block_table=list(tables[i][0]), sampling_params=params,
                num_samples=1 if end == len(tokens) else 0,
                prompt_token_ids=prompt, output_token_ids=list(outputs[i]),
                group_block_tables=[list(t) for t in tables[i]] if num_groups > 1 else None))
        result = runner.execute(SchedulerOutput(scheduled=scheduled))
        for r in scheduled:
            i = int(r.request_id[1:])
            computed[i] = r.start_pos + r.num_new_tokens
            if r.num_samples:
                outputs[i].extend(result.sampled_token_ids[r.request_id])
    return outputs


def prefill_logits(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    """Last-position logits [len(prompts), vocab] of one prefill step over all prompts."""
    alloc = BlockAllocator(runner.block_size, runner.kv_cache.num_blocks)
    scheduled = []
    num_groups = num_kv_groups(runner)
    for i, p in enumerate(prompts):
        tables: list[list[int]] = [[] for _ in range(num_groups)]
        for table in tables:
            alloc.grow(table, len(p))
        scheduled.append(ScheduledRequest(f"r{i}", p, 0, tables[0], SamplingParams(temperature=0.0),
                                          group_block_tables=tables if num_groups > 1 else None))
    reqs, ids, pos, meta = runner.prepare_inputs(scheduled)
    with torch.inference_mode():
        hidden = runner.model(ids, pos, runner.layer_kv_caches, meta)
        logits = runner.model.compute_logits(select_logits_rows(reqs).gather(hidden))
    order = [int(r.request_id[1:]) for r in reqs]
    out = torch.empty_like(logits)
    out[torch.tensor(order, device=out.device)] = logits
    return out.cpu()  # compared with CPU references
