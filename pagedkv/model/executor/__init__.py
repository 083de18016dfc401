"""Executors: what runs the model for the engine, behind one interface (`Executor`).

- In one process, the `ModelRunner` itself is the executor (it has every method below).
- `MultiProcExecutor` (multiproc.py): tensor parallelism. Rank 0's runner runs in the engine's
  process; ranks 1..N-1 are worker processes (worker.py) that get each step's SchedulerOutput
  by broadcast and run their shard; collectives over torch.distributed (gloo on CPU, NCCL on
  CUDA). Rank 0 returns its sampled result, as the one-process runner does.
- `RayExecutor` (ray_executor.py, `distributed_executor_backend='ray'`): the same group with
  ranks 1..N-1 as Ray actors placed by a placement group (the `ray` extra).
"""

from __future__ import annotations

from typing import Protocol

from pagedkv.sched.output import ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    """What the engine calls; reads of `model_config`, `kv_cache_spec`, `kv_cache`, `device`,
    `weights_bytes`, `kv_connector` are rank 0's."""

    def allocate_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        """Every rank's KV cache (and, with a KV store configured, its store)."""

    def capture_cuda_graphs(self, batch_sizes: list[int],
                            max_model_len: int | None = None) -> bool: ...

    def profile_activation_peak(self, num_tokens: int, max_num_seqs: int,
                                max_model_len: int) -> int: ...

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...
