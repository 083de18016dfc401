"""RayExecutor: tensor parallelism with the worker ranks as Ray actors
(`--distributed-executor-backend ray`).

The same group as `MultiProcExecutor` (whose commands, heartbeat and failure handling it
inherits): rank 0 runs in the engine's process, which must be a node of a running Ray cluster
(`ray start` there, or RAY_ADDRESS); ranks 1..N-1 are actors (`_RankActor`, each running the
worker loop of worker.py) placed by a placement group of one bundle per rank, bundle 0 pinned
to this node. The bundles are PACKed; with nnodes > 1, STRICT_SPREAD (a node per rank) when
nnodes equals the ranks, else SPREAD.
The ranks meet at `tcp://<this node's Ray IP>:<port>` (master_port, else a free one) and talk
over torch.distributed as with worker processes. An actor that dies (killed, its node lost)
ends its `run` task with an error; the heartbeat sees it and the engine fails within the
timeout. Needs the `ray` extra (`pip install 'pagedkv[ray]'`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from pagedkv.model.executor.multiproc import MultiProcExecutor
from pagedkv.model.runner_config import RunnerConfig

logger = logging.getLogger(__name__)

# The environment an actor takes from the engine's (how gloo and the kernels pick their
# interface and threads).
_FORWARDED_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME",
                  "PAGEDKV_CACHE_DIR")


def import_ray() -> Any:
    """The `ray` module, or a ValueError saying how to get it."""
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend='ray' needs Ray: "
                         "pip install 'pagedkv[ray]'") from None
    return ray


def placement_strategy(size: int, nnodes: int) -> str:
    """STRICT_SPREAD (every rank on its own node) when asked for one rank per node, SPREAD
    for several nodes of several ranks, else PACK."""
    if nnodes > 1:
        return "STRICT_SPREAD" if nnodes == size else "SPREAD"
    return "PACK"


class _RankActor:
    """One worker rank; `run` is the worker loop, returning its exit code."""

    def run(self, rank: int, size: int, init_method: str, device: str, timeout_s: float,
            cpu_threads: int | None, env: dict[str, str]) -> int:
        from pagedkv.model.executor.worker import run_worker

        os.environ.update(env)
        return run_worker(rank, 0, size, init_method, device, timeout_s, cpu_threads)


class RayExecutor(MultiProcExecutor):
    """`size` ranks: rank 0 here, 1..size-1 Ray actors (see the module docstring)."""

    def __init__(self, config: RunnerConfig, *, size: int, timeout_s: float, nnodes: int = 1,
                 master_port: int | None = None) -> None:
        self._ray = ray = import_ray()
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS", "auto")
            try:  # joins a running cluster; never starts one
                ray.init(address=address, log_to_driver=False)
            except ConnectionError as exc:
                raise RuntimeError(
                    "distributed_executor_backend='ray' runs on a running Ray cluster: `ray "
                    f"start --head` on this node, or RAY_ADDRESS (tried {address!r}): {exc}"
                ) from None
        self.node_ip = ray.util.get_node_ip_address()
        self.strategy = placement_strategy(size, nnodes)
        self._refs: list[Any] = []
        self._placement = None
        init_method = f"tcp://{self.node_ip}:{master_port or free_port(self.node_ip)}"
        super().__init__(config, size=size, ranks_per_node=1, timeout_s=timeout_s,
                         init_method=init_method)

    # ---- the hooks of MultiProcExecutor --------------------------------------------------

    def _start_workers(self, ranks: range, init_method: str, device: str,
                       worker_threads: int | None) -> list[Any]:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self._ray
        bundles = [{"CPU": 1, f"node:{self.node_ip}": 0.001}] + [{"CPU": 1}] * (self.size - 1)
        self._placement = placement_group(bundles, strategy=self.strategy)
        ready, _ = ray.wait([self._placement.ready()], timeout=self.timeout_s)
        if not ready:
            self._stop_workers(time.monotonic())
            raise RuntimeError(
                f"Ray could not place {self.size} tensor-parallel ranks ({self.strategy}, one "
                f"CPU each, rank 0 on this node {self.node_ip}) within {self.timeout_s} s: "
                f"the cluster has {ray.cluster_resources().get('CPU', 0):g} CPUs on "
                f"{len(ray.nodes())} node(s)")
        env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
        actor_class = ray.remote(num_cpus=1)(_RankActor)
        workers = []
        for rank in range(1, self.size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._placement, placement_group_bundle_index=rank)
            actor = actor_class.options(scheduling_strategy=strategy,
                                        name=f"pagedkv-tp-rank{rank}-{os.getpid()}").remote()
            workers.append(actor)
            self._refs.append(actor.run.remote(rank, self.size, init_method, device,
                                               self.timeout_s, worker_threads, env))
        logger.info("tensor parallel over Ray: %d actors (%s), rendezvous %s", len(workers),
                    self.strategy, init_method)
        return workers

    def _dead_worker(self) -> str | None:
        ray = self._ray
        if not self._refs:
            return None
        ended, _ = ray.wait(self._refs, num_returns=1, timeout=0)
        for ref in ended:
            rank = self._refs.index(ref) + 1
            try:
                code = ray.get(ref, timeout=1)
            except Exception as exc:  # RayActorError: killed, or its node is gone
                return f"worker rank {rank} (Ray actor) died: {type(exc).__name__}"
            return f"worker rank {rank} (Ray actor) exited with code {code}"
        return None

    def _stop_workers(self, deadline: float) -> None:
        ray = self._ray
        if self._refs:
            ray.wait(self._refs, num_returns=len(self._refs),
                     timeout=max(0.0, deadline - time.monotonic()))
        for actor in getattr(self, "workers", ()):
            ray.kill(actor)
        if self._placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._placement)
            self._placement = None

    def node_ips(self) -> list[str]:
        """Each rank's node address, in rank order (its placement group bundle's node)."""
        from ray.util import placement_group_table

        ray = self._ray
        where = placement_group_table(self._placement)["bundles_to_node_id"]
        address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        return [address[where[rank]] for rank in range(self.size)]


def free_port(addr: str) -> int:
    """A TCP port free on `addr` (this node's address) right now."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]
