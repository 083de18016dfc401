"""TensorParallelGroup: one rank's handle on its tensor-parallel group (torch.distributed).

No global state: the group is a `ProcessGroupGloo` / `ProcessGroupNCCL` object built from its
own store (not `init_process_group`'s default group), so two engines can live in one process
and tests can build several groups. Every collective waits at most `timeout` and raises
`CollectiveError` instead of hanging when a peer died or stopped answering.

Objects (a step's batch description) travel as pickled bytes in two broadcasts over a CPU
(gloo) group: first the length, then the bytes. Tensors (activations) go over the device
group: gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import contextlib
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# The longest ranks may take to start, join and load their weights (a worker process that
# dies meanwhile is noticed at once); collectives then wait at most their own timeout.
JOIN_TIMEOUT_S = 600.0


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a peer rank died, hung or hit an error."""


def make_store(init_method: str, rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The rendezvous store for `init_method`: "file:///path" (one machine; no port at all) or
    "tcp://host:port" (rank 0 serves it on `port`, the others connect)."""
    if init_method.startswith("file://"):
        return dist.FileStore(init_method.removeprefix("file://"), world_size)
    if init_method.startswith("tcp://"):
        host, _, port = init_method.removeprefix("tcp://").rpartition(":")
        return dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=timeout,
                             wait_for_workers=False)
    raise ValueError(f"init_method must start with file:// or tcp://, got {init_method!r}")


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of this machine's `local_rank`-th rank: for an unindexed CUDA device, CUDA
    device `local_rank` (one GPU per rank); `device` itself otherwise (CPU, or an explicit
    index). ValueError when this machine has too few CUDA devices."""
    if device.type != "cuda" or device.index is not None:
        return device
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(f"tensor parallel: this machine runs rank {local_rank} of its ranks on "
                         f"CUDA device {local_rank}, but has {count} CUDA device(s)")
    return torch.device("cuda", local_rank)


def _wait_for_ranks(store: dist.Store, flag: str, size: int, timeout_s: float,
                    watch: Callable[[], str | None] | None) -> None:
    """Poll until every rank set `flag` (a worker process dying meanwhile ends it at once)."""
    deadline = time.monotonic() + timeout_s
    keys = [f"{flag}/{r}" for r in range(size)]
    while not store.check(keys):
        reason = watch() if watch is not None else None
        if reason is not None:
            raise CollectiveError(f"a rank failed before reaching {flag!r}: {reason}")
        if time.monotonic() > deadline:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            raise CollectiveError(f"ranks {missing} did not reach {flag!r} "
                                  f"within {timeout_s:g} s")
        time.sleep(0.05)


@dataclass
class TensorParallelGroup:
    """Rank `rank` of `size` ranks. `cpu_group` (gloo) carries objects; `device_group` carries
    activations (the same object on CPU). Valid until `close()`."""

    rank: int
    size: int
    cpu_group: Any
    device_group: Any
    timeout: timedelta
    flags: Any = None  # the rendezvous store: `set_flag` / `wait_for_flag`
    # Seconds this rank spent in each kind of collective, waiting for slower ranks included
    # (benchmarks/bench_tensor_parallel.py reads it; two clock reads per collective).
    seconds: dict[str, float] = field(default_factory=dict)

    @classmethod
    def connect(cls, init_method: str, rank: int, size: int, device: torch.device,
                timeout_s: float, watch: Callable[[], str | None] | None = None,
                join_timeout_s: float = JOIN_TIMEOUT_S) -> TensorParallelGroup:
        """Join the group: blocks until every rank has joined, at most `join_timeout_s` (ranks
        start at different times, other machines too); collectives then wait at most
        `timeout_s`. `watch` is called while waiting: a reason (a worker process already
        died) ends the wait with CollectiveError at once."""
        timeout = timedelta(seconds=timeout_s)
        join_timeout = timedelta(seconds=max(timeout_s, join_timeout_s))
        store = make_store(init_method, rank, size, join_timeout)
        store.set_timeout(join_timeout)
        group_store = dist.PrefixStore("flags", store)
        group_store.set(f"joined/{rank}", "1")
        _wait_for_ranks(group_store, "joined", size, join_timeout.total_seconds(), watch)
        cpu_group = dist.ProcessGroupGloo(dist.PrefixStore("cpu", store), rank, size, timeout)
        device_group = cpu_group
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL binds each rank's communicator to its device
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            device_group = dist.ProcessGroupNCCL(dist.PrefixStore("dev", store), rank, size, opts)
        return cls(rank, size, cpu_group, device_group, timeout, group_store)

    @property
    def is_driver(self) -> bool:
        """Rank 0: the rank that schedules and samples."""
        return self.rank == 0

    def set_flag(self, flag: str) -> None:
        """Tell rank 0 this rank reached `flag` (e.g. its model is loaded)."""
        self.flags.set(f"{flag}/{self.rank}", "1")

    def wait_for_flag(self, flag: str, timeout_s: float = JOIN_TIMEOUT_S,
                      watch: Callable[[], str | None] | None = None) -> None:
        """Set `flag` and wait until every rank set it, at most `timeout_s`, calling `watch`
        meanwhile: for phases longer than a collective may wait (loading weights)."""
        self.set_flag(flag)
        _wait_for_ranks(self.flags, flag, self.size, timeout_s, watch)

    def _wait(self, work: Any, what: str) -> None:
        try:
            if not work.wait(self.timeout):
                raise CollectiveError(f"{what} timed out after {self.timeout.total_seconds():g} s")
        except CollectiveError:
            raise
        except RuntimeError as exc:
            raise CollectiveError(f"{what} failed on rank {self.rank}: {exc}") from exc

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns `t`."""
        start = time.perf_counter()
        self._wait(self.device_group.allreduce([t]), "all-reduce")
        self.seconds["all-reduce"] = self.seconds.get("all-reduce", 0.0) \
            + time.perf_counter() - start
        return t

    def gather_to_driver(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `t` (same shape on every rank) on rank 0, in rank order; None elsewhere."""
        start = time.perf_counter()
        try:
            return self._gather_to_driver(t)
        finally:
            self.seconds["gather"] = self.seconds.get("gather", 0.0) + time.perf_counter() - start

    def _gather_to_driver(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        if t.device.type == "cuda":  # NCCL has no gather: all-gather
            outs = [torch.empty_like(t) for _ in range(self.size)]
            self._wait(self.device_group.allgather([outs], [t]), "all-gather")
            return outs if self.is_driver else None
        outs = [[torch.empty_like(t) for _ in range(self.size)]] if self.is_driver else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self._wait(self.device_group.gather(outs, [t], opts), "gather")
        return outs[0] if self.is_driver else None

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (rank 0 passes it, the others get it back)."""
        start = time.perf_counter()
        try:
            return self._broadcast_object(obj)
        finally:
            self.seconds["broadcast"] = self.seconds.get("broadcast", 0.0) \
                + time.perf_counter() - start

    def _broadcast_object(self, obj: Any) -> Any:
        if self.is_driver:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            length = torch.tensor([len(data)], dtype=torch.long)
        else:
            length = torch.zeros(1, dtype=torch.long)
        self._wait(self.cpu_group.broadcast([length], dist.BroadcastOptions()), "broadcast")
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.is_driver \
            else torch.empty(int(length), dtype=torch.uint8)
        self._wait(self.cpu_group.broadcast([buf], dist.BroadcastOptions()), "broadcast")
        return obj if self.is_driver else pickle.loads(buf.numpy().tobytes())

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` on rank 0 (a list in rank order), None on the others."""
        objs = self.all_gather_objects(obj)
        return objs if self.is_driver else None

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj` on every rank (a list in rank order)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        length = torch.tensor([len(data)], dtype=torch.long)
        lengths = [torch.zeros(1, dtype=torch.long) for _ in range(self.size)]
        self._wait(self.cpu_group.allgather([lengths], [length]), "all-gather")
        width = int(max(int(x) for x in lengths))
        buf = torch.zeros(width, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        bufs = [torch.empty(width, dtype=torch.uint8) for _ in range(self.size)]
        self._wait(self.cpu_group.allgather([bufs], [buf]), "all-gather")
        return [pickle.loads(b[: int(n)].numpy().tobytes()) for b, n in zip(bufs, lengths,
                                                                               strict=True)]

    def close(self) -> None:
        """Drop the groups (their sockets close; peers see the connection end)."""
        for group in {id(self.cpu_group): self.cpu_group,
                      id(self.device_group): self.device_group}.values():
            with contextlib.suppress(RuntimeError, AttributeError):
                group.shutdown()
        self.cpu_group = self.device_group = None
