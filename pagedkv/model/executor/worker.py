"""A tensor-parallel worker rank: joins the group, builds its ModelRunner shard from what rank 0
broadcasts, then runs each command rank 0 broadcasts until told to stop (or rank 0 is gone).

Commands (tuples, pickled): ("execute", SchedulerOutput) runs the step's block moves and
forward pass (rank 0 samples); ("call", method, args) runs a runner method on every rank and
gathers each rank's ("ok", value) or ("error", text) to rank 0; ("noop",) is rank 0's
heartbeat (an idle engine still proves it is alive, so no rank waits out its timeout);
("shutdown",) ends the loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import traceback
from dataclasses import replace
from typing import Any

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def run_call(runner: Any, method: str, args: tuple) -> tuple[str, Any]:
    """("ok", result) of `runner.method(*args)` (`method` may be a dotted path below the
    runner: "kv_connector.transfer.poll"), or ("error", what it raised)."""
    try:
        target = runner
        for part in method.split("."):
            target = getattr(target, part)
        return "ok", target(*args)
    except Exception as exc:  # reported to rank 0, which raises it
        return "error", f"{type(exc).__name__}: {exc}"


def worker_main(rank: int, local_rank: int, size: int, init_method: str, device: str,
                timeout_s: float, cpu_threads: int | None) -> None:
    """The process body of rank `rank` (1..size-1), the `local_rank`-th on its machine (its
    CUDA device, see `rank_device`). Exits 0 after "shutdown"; 3 when the
    group broke (rank 0 died or hung past `timeout_s`), 1 on any other error. The process
    ends with os._exit: the interpreter's own teardown (torch's) took seconds."""
    code = 1
    try:
        code = run_worker(rank, local_rank, size, init_method, device, timeout_s, cpu_threads)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def die_with_parent() -> None:
    """Have the kernel kill this process when its parent (the engine core, rank 0) dies, on
    Linux (prctl PR_SET_PDEATHSIG); elsewhere the group's collective timeout ends it."""
    if not sys.platform.startswith("linux"):
        return
    parent = multiprocessing.parent_process()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent is not None and os.getppid() != parent.pid:  # it died before that took effect
        os._exit(3)


def run_worker(rank: int, local_rank: int, size: int, init_method: str, device: str,
               timeout_s: float, cpu_threads: int | None) -> int:
    """The worker loop (see the module docstring); returns the exit code."""
    import torch

    from pagedkv.model.parallel.group import CollectiveError, TensorParallelGroup, rank_device
    from pagedkv.model.runner import ModelRunner, resolve_device

    if threading.current_thread() is threading.main_thread():  # (a Ray actor's may not be)
        for signum in (signal.SIGINT, signal.SIGTERM):  # a group-wide stop is rank 0's
            signal.signal(signum, signal.SIG_IGN)
    die_with_parent()
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    dev = rank_device(resolve_device(device), local_rank)
    group = TensorParallelGroup.connect(init_method, rank, size, dev, timeout_s)
    logger.info("rank %d of %d joined the group at %s", rank, size, init_method)
    try:
        _, config = group.broadcast_object()  # ("init", RunnerConfig)
        try:
            runner = ModelRunner.from_config(replace(config, device=str(dev)),
                                             tensor_parallel=group)
            status: tuple[str, Any] = ("ok", None)
        except Exception as exc:
            runner, status = None, ("error", f"{type(exc).__name__}: {exc}")
        group.wait_for_flag("loaded")  # every rank loaded (or failed): no collective waits on it
        group.gather_objects(status)
        if runner is None:
            return 1
        logger.info("rank %d of %d: model loaded on %s; running rank 0's steps", rank, size, dev)
        while True:
            command = group.broadcast_object()
            if command[0] == "execute":
                try:
                    runner.execute(command[1])
                except CollectiveError:
                    raise
                except Exception:  # rank 0 hits the same error on the same inputs
                    logger.exception("rank %d: step failed", rank)
            elif command[0] == "call":
                group.gather_objects(run_call(runner, command[1], command[2]))
            elif command[0] == "shutdown":
                runner.shutdown()
                return 0
    except CollectiveError as exc:
        print(f"pagedkv tensor-parallel rank {rank} (pid {os.getpid()}): {exc}; exiting",
              file=sys.stderr)
        return 3
    finally:
        group.close()
