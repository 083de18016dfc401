"""MultiProcExecutor: tensor parallelism over worker processes (see executor/__init__.py).

Rank 0 (this process) holds the group's first shard and the only sampler: the logits are
gathered to it, so one set of per-request generators draws every token, exactly as with one
process (no per-rank seeds to keep in step). A heartbeat thread broadcasts a no-op whenever
no command went out for a quarter of the timeout and watches the worker processes: a worker
that died or stopped answering makes the next (or the current) call raise `EngineFatalError`
within `timeout_s`, never a silent hang. `shutdown()` stops every local rank (asks, then kills).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from pagedkv.config.errors import EngineFatalError
from pagedkv.model.executor.worker import run_call, worker_main
from pagedkv.model.parallel.group import CollectiveError, TensorParallelGroup, rank_device
from pagedkv.model.runner_config import RunnerConfig
from pagedkv.sched.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


def worker_view(out: SchedulerOutput) -> SchedulerOutput:
    """What a worker needs of a step (no grammar state: rank 0 samples), picklable; the
    KV-store work stays (every rank loads and saves its own heads of the same blocks)."""
    if not any(r.grammar is not None for r in out.scheduled):
        return out
    return replace(out, scheduled=[replace(r, grammar=None) for r in out.scheduled])


class MultiProcExecutor:
    """`size` ranks, `ranks_per_node` of them on this machine (rank 0 here, 1.. spawned);
    the others join from other machines (`pagedkv serve ... --node-rank K`). Every rank builds
    its runner from `config` (the KV spec already one rank's) on its own device."""

    def __init__(self, config: RunnerConfig, *, size: int, ranks_per_node: int,
                 timeout_s: float, init_method: str | None = None) -> None:
        from pagedkv.model.runner import ModelRunner, resolve_device

        device, worker_threads = config.device, config.cpu_threads
        resolved = resolve_device(device)
        rank_device(resolved, ranks_per_node - 1)  # enough CUDA devices, before any process
        dev = rank_device(resolved, 0)
        config = replace(config, device=str(dev))
        self.size, self.timeout_s = size, timeout_s
        self._tmpdir = None
        if init_method is None:  # one machine: a rendezvous file, no port to pick
            self._tmpdir = tempfile.mkdtemp(prefix="pagedkv-tp-")
            init_method = "file://" + str(Path(self._tmpdir) / "rendezvous")
        self.workers = self._start_workers(range(1, ranks_per_node), init_method, device,
                                           worker_threads)
        self._lock = threading.Lock()
        self._dead: str | None = None
        self._closed = threading.Event()
        self.group: TensorParallelGroup | None = None
        self.runner = None
        try:
            self.group = TensorParallelGroup.connect(init_method, 0, size, dev, timeout_s,
                                                     watch=self._dead_worker)
            self.group.broadcast_object(("init", config))
            try:
                self.runner = ModelRunner.from_config(config, tensor_parallel=self.group)
                status: tuple[str, Any] = ("ok", None)
            except Exception as exc:
                status = ("error", f"{type(exc).__name__}: {exc}")
                raise
            finally:  # loading may take longer than a collective may wait
                self.group.wait_for_flag("loaded", watch=self._dead_worker)
                statuses = self.group.gather_objects(status)
            self._raise_errors(statuses, "loading the model")
        except BaseException:
            self._teardown()
            raise
        self._last_command = time.monotonic()
        self._heartbeat = threading.Thread(target=self._watch, name="pagedkv-tp-heartbeat",
                                           daemon=True)
        self._heartbeat.start()

    # ---- reads go to rank 0's runner -----------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        runner = self.__dict__.get("runner")
        if runner is None:
            raise AttributeError(name)
        return getattr(runner, name)

    # ---- the executor interface ----------------------------------------------------------

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Every rank runs the step; rank 0's sampled result comes back."""
        with self._command(("execute", worker_view(out))):
            return self.runner.execute(out)

    def allocate_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        """Every rank's KV cache; with a KV store configured, every rank builds its own store
        and connector over it (see store/factory.py)."""
        self.collective_rpc("allocate_kv_cache", num_blocks, num_host_blocks)

    def capture_cuda_graphs(self, batch_sizes: list[int], max_model_len: int | None = None) -> bool:
        return False  # tensor parallel runs eagerly (graphs would capture the collectives)

    def profile_activation_peak(self, num_tokens: int, max_num_seqs: int,
                                max_model_len: int) -> int:
        """The largest rank's peak (every rank runs the profile forward pass together)."""
        return max(self.collective_rpc("profile_activation_peak", num_tokens, max_num_seqs,
                                       max_model_len))

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` of every rank's runner; their results in rank order."""
        with self._command(("call", method, args)):
            mine = run_call(self.runner, method, args)
            statuses = self.group.gather_objects(mine)
        self._raise_errors(statuses, method)
        return [value for _, value in statuses]

    def shutdown(self) -> None:
        """Stop every rank and free rank 0's runner (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._dead is None and self.group is not None:
            try:
                with self._lock:
                    self.group.broadcast_object(("shutdown",))
            except CollectiveError:
                pass
        self._teardown()

    # ---- internals -----------------------------------------------------------------------

    def _command(self, command: tuple) -> _Command:
        return _Command(self, command)

    def _fail(self, why: str) -> EngineFatalError:
        if self._dead is None:
            self._dead = why
            logger.error("tensor parallel: %s", why)
        return EngineFatalError(f"tensor-parallel group failed: {self._dead}")

    def _reason(self, exc: Exception) -> str:
        """Why a collective failed: a worker that died (given a second to be reaped: its
        socket closes before its exit code is known), else the collective's own error."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            dead = self._dead_worker()
            if dead is not None:
                return dead
            time.sleep(0.02)
        return str(exc)

    def _start_workers(self, ranks: range, init_method: str, device: str,
                       worker_threads: int | None) -> list[Any]:
        """Start the worker ranks `ranks` (spawned processes here; other executors override)."""
        ctx = mp.get_context("spawn")
        workers = [ctx.Process(target=worker_main, name=f"pagedkv-tp-rank{r}", daemon=True,
                               args=(r, r, self.size, init_method, device, self.timeout_s,
                                     worker_threads))
                   for r in ranks]
        for p in workers:
            p.start()
        return workers

    def _dead_worker(self) -> str | None:
        for rank, p in enumerate(self.workers, start=1):
            if p.exitcode is not None:
                return f"worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def _raise_errors(self, statuses: list[tuple[str, Any]], what: str) -> None:
        """Raise what the ranks' calls raised: a ValueError when every failing rank's was one
        (bad input, e.g. a tier's path: as with one process), else a RuntimeError."""
        errors = {r: v for r, (s, v) in enumerate(statuses) if s == "error"}
        if errors:
            bad_input = all(v.startswith("ValueError:") for v in errors.values())
            raise (ValueError if bad_input else RuntimeError)(
                f"tensor parallel, {what} failed on "
                + "; ".join(f"rank {r}: {v}" for r, v in errors.items()))

    def _watch(self) -> None:
        """Heartbeat and worker watch, until shutdown or the group fails."""
        period = max(self.timeout_s / 4, 0.05)
        while not self._closed.wait(min(period, 0.5)):
            dead = self._dead_worker()
            if dead is not None:
                self._fail(dead)
                return
            if time.monotonic() - self._last_command < period or not self._lock.acquire(False):
                continue
            try:
                self.group.broadcast_object(("noop",))
                self._last_command = time.monotonic()
            except CollectiveError as exc:
                self._fail(self._reason(exc))
                return
            finally:
                self._lock.release()

    def _stop_workers(self, deadline: float) -> None:
        """Wait for the workers to end until `deadline` (monotonic), then kill the rest."""
        for p in self.workers:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5.0)

    def _teardown(self) -> None:
        self._closed.set()
        self._stop_workers(time.monotonic() + min(self.timeout_s, 5.0))
        if self.group is not None:
            self.group.close()
        if self.runner is not None:
            self.runner.shutdown()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)


class _Command:
    """Context of one command: fails fast when the group is already dead, holds the lock
    (no heartbeat in between), and turns a broken collective into EngineFatalError."""

    def __init__(self, executor: MultiProcExecutor, command: tuple) -> None:
        self.executor, self.command = executor, command

    def __enter__(self) -> None:
        ex = self.executor
        if ex._dead is not None or ex._closed.is_set():
            raise ex._fail(ex._dead or "the executor was shut down")
        dead = ex._dead_worker()
        if dead is not None:
            raise ex._fail(dead)
        ex._lock.acquire()
        try:
            ex.group.broadcast_object(self.command)
        except CollectiveError as exc:
            ex._lock.release()
            raise ex._fail(ex._reason(exc)) from exc

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        ex = self.executor
        ex._last_command = time.monotonic()
        ex._lock.release()
        if isinstance(exc, CollectiveError):
            raise ex._fail(ex._reason(exc)) from exc
        return False
