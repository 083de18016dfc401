"""DPCoreClient: data parallelism, N engine cores behind one frontend (vLLM's
`--data-parallel-size`).

Each core is its own process (`MPCoreClient`: its own KV cache, scheduler and, with
`tensor_parallel_size` > 1, its own tensor-parallel group), started from the same arguments
but for its `data_parallel_rank` (stamped on its KV events; its KV-event ports offset by the
rank, as vLLM offsets them) and, unless `cpu_threads` is given, its share of this machine's
cores. The frontend is the same `LLMEngine` / `AsyncEngine` as with one core: this client
satisfies `CoreClient`, so nothing above it changes.

- A new request goes to the core `CorePlacer` picks (pagedkv/engine/placement/cores.py: the
  router's kv-aware policy over this client's books: the prefix each core computed, its
  requests in flight and queued prefill, its queues and KV usage after its latest step).
- Aborts go to the core that holds each sample; step outputs come back from every core,
  one core step at a time (in rotation among the cores that have one waiting).
- Utility calls: "get_stats" sums the cores' stats (KV usage weighed by pool size),
  "get_core_stats" lists them (core 0 first), "check_invariants" runs on every core; the
  pin calls go to the core whose record holds the prompt's prefix; the rest (the dashboard's
  feed, "now", "cpu_kernel_choice") to core 0.
- A core that dies is the engine's death, as with one core: the next `get_outputs()` raises
  CoreDeadError naming the core, so every request in flight fails with that reason and the
  server reports unhealthy.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import socket
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import zmq

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.core_client import CoreClient, CoreDeadError, MPCoreClient, start_core_client
from pagedkv.engine.messages import Abort, CoreOutput, EngineCoreRequest, EngineReady
from pagedkv.engine.placement.cores import CoreLoad, CorePlacer
from pagedkv.engine.stats import sum_stats
from pagedkv.kv.hashing import RequestBlockHasher
from pagedkv.sched.request import child_request_id

# Utility calls every core answers (the answers combined); the pin calls follow the prefix.
_FAN_OUT = frozenset({"get_stats", "get_core_stats", "check_invariants"})
_BY_PREFIX = frozenset({"is_prefix_cached", "pin_prefix", "unpin_prefix"})


def start_client(args: EngineArgs, tokenizer: Any, *, core_process: bool) -> CoreClient:
    """The frontend's core client: N core processes when `args.data_parallel_size` > 1
    (whatever `core_process` says), else `start_core_client`'s."""
    if args.data_parallel_size > 1:
        return DPCoreClient(args, num_cpus=len(os.sched_getaffinity(0)))
    return start_core_client(args, tokenizer, core_process=core_process)


def cpu_share(args: EngineArgs, num_cpus: int) -> int:
    """Compute threads for each rank of each core: the given `cpu_threads`, else this
    machine's cores split evenly over every rank of every core (at least one)."""
    if args.cpu_threads is not None:
        return args.cpu_threads
    ranks = args.data_parallel_size * (args.tensor_parallel_size // args.nnodes)
    return max(1, num_cpus // ranks)


def offset_endpoint_port(endpoint: str | None, offset: int) -> str | None:
    """`endpoint` with its TCP port moved up by `offset` (vLLM's rule for data-parallel
    KV-event publishers); a wildcard port ("*"), an ipc path or None stays as it is, an ipc
    path gaining a `-<offset>` suffix so the cores never share one."""
    if endpoint is None or offset == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}-{offset}"
    head, sep, port = endpoint.rpartition(":")
    if sep and port.isdigit():
        return f"{head}:{int(port) + offset}"
    return endpoint


def core_args(args: EngineArgs, rank: int, num_cpus: int) -> EngineArgs:
    """The arguments of data-parallel core `rank`."""
    events = args.kv_events_config
    if events is not None and rank:
        config = json.loads(events) if isinstance(events, str) else dict(
            events if isinstance(events, dict) else dataclasses.asdict(events))
        for key in ("endpoint", "replay_endpoint"):
            if config.get(key) is not None:
                config[key] = offset_endpoint_port(config[key], rank)
        events = json.dumps(config)
    return dataclasses.replace(args, data_parallel_rank=rank, kv_events_config=events,
                               cpu_threads=cpu_share(args, num_cpus))


@dataclass
class _PromptView:
    """What `RequestBlockHasher` reads of a request."""

    all_token_ids: list[int]
    cache_salt: str | None
    lora_name: str | None = None


class DPCoreClient:
    """N core processes behind one `CoreClient`; see the module docstring. Owned by one
    thread, like `MPCoreClient`; `wake()` and `busy_for()` from any."""

    def __init__(self, args: EngineArgs, *, num_cpus: int, poll_s: float = 0.25) -> None:
        self.poll_s = poll_s
        self.size = args.data_parallel_size
        self.cores: list[MPCoreClient] = self._start(
            [core_args(args, rank, num_cpus) for rank in range(self.size)], poll_s)
        self.ready: EngineReady = self.cores[0].ready
        self.placer = CorePlacer(self.size, capacity_blocks=self.ready.num_usable_blocks)
        self._hasher = RequestBlockHasher(args.prefix_caching_hash_algo, self.ready.block_size)
        self._poller = zmq.Poller()
        for core in self.cores:
            self._poller.register(core.output_socket, zmq.POLLIN)
        self._waker_r, self._waker_w = socket.socketpair()
        self._waker_r.setblocking(False)
        self._waker_w.setblocking(False)
        self._poller.register(self._waker_r.fileno(), zmq.POLLIN)
        self._parent: dict[str, str] = {}  # sample id -> its request id
        self._samples_left: dict[str, int] = {}  # request id -> its unfinished samples
        self._turn = 0
        self._output_time: float | None = None
        self._closed = False

    @staticmethod
    def _start(all_args: list[EngineArgs], poll_s: float) -> list[MPCoreClient]:
        """Start every core at once; if one fails, stop the others and raise its error."""
        with ThreadPoolExecutor(len(all_args)) as pool:
            futures = [pool.submit(MPCoreClient, a, poll_s=poll_s) for a in all_args]
        started = [f.result() for f in futures if f.exception() is None]
        failed = next((f.exception() for f in futures if f.exception() is not None), None)
        if failed is not None:
            for core in started:
                core.shutdown()
            raise failed
        return started

    # ---- requests -----------------------------------------------------------------------

    def block_hashes(self, token_ids: list[int], cache_salt: str | None) -> list[bytes]:
        """The prompt's full blocks' hashes, as every core hashes them."""
        return self._hasher(_PromptView(token_ids, cache_salt), [])

    def add_request(self, request: EngineCoreRequest) -> None:
        rid = request.request_id
        n = getattr(request.sampling_params, "n", 1)
        hashes = self.block_hashes(request.prompt_token_ids, request.cache_salt)
        core = self.placer.place(rid, len(request.prompt_token_ids), hashes)
        for i in range(n):
            self._parent[rid if i == 0 else child_request_id(rid, i)] = rid
        self._samples_left[rid] = n
        try:
            self._guard(core, lambda: self.cores[core].add_request(request))
        except BaseException:
            self._finish_samples([rid] + [child_request_id(rid, i) for i in range(1, n)])
            raise

    def abort(self, message: Abort) -> None:
        """Send each sample's abort to its core; the samples leave the books at once."""
        by_core: dict[int, list[str]] = collections.defaultdict(list)
        for sample_id in message.request_ids:
            rid = self._parent.get(sample_id)
            core = None if rid is None else self.placer.core_of(rid)
            if core is not None:
                by_core[core].append(sample_id)
        for core, ids in by_core.items():
            self.cores[core].abort(Abort(ids, message.status, message.stop_reason))
        self._finish_samples(message.request_ids)

    def _finish_samples(self, sample_ids: Sequence[str]) -> None:
        for sample_id in sample_ids:
            rid = self._parent.pop(sample_id, None)
            if rid is None:
                continue
            self._samples_left[rid] -= 1
            if self._samples_left[rid] == 0:
                del self._samples_left[rid]
                self.placer.finished(rid)

    def requests_on(self, core: int) -> int:
        """Requests in flight on `core` (placed, not finished)."""
        return self.placer.in_flight[core]

    # ---- outputs ------------------------------------------------------------------------

    def get_outputs(self) -> list[CoreOutput]:
        core = self._next_waiting()
        if core is None:
            self._receive(self.poll_s)
            core = self._next_waiting()
        if core is None:
            return []
        client = self.cores[core]
        step = client.take_step()
        self._output_time = step.timestamp or None
        self.placer.update_load(core, CoreLoad(step.num_running, step.num_waiting,
                                               step.kv_usage))
        self._book(step.outputs)
        return step.outputs

    def _book(self, outputs: list[CoreOutput]) -> None:
        finished = []
        for out in outputs:
            rid = self._parent.get(out.request_id)
            if rid is None:
                continue
            if out.new_token_ids or out.finish_reason is not None:
                self.placer.prefilled(rid)
            if out.finish_reason is not None:
                finished.append(out.request_id)
        self._finish_samples(finished)

    def _next_waiting(self) -> int | None:
        """The next core, in rotation, with a step's outputs waiting."""
        for i in range(self.size):
            core = (self._turn + i) % self.size
            if self.cores[core].has_outputs():
                self._turn = core + 1
                return core
        return None

    def _receive(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for any core's message (or `wake()`), then let every core
        take what arrived. CoreDeadError naming the core when one is gone."""
        ready = dict(self._poller.poll(int(timeout_s * 1000)))
        if self._waker_r.fileno() in ready:
            with contextlib.suppress(BlockingIOError):
                self._waker_r.recv(4096)
        for core in range(self.size):
            self._guard(core, lambda c=core: self.cores[c].receive(0.0))

    def _guard(self, core: int, action: Callable[[], Any]) -> Any:
        """`action()`, its CoreDeadError re-raised naming the core."""
        try:
            return action()
        except CoreDeadError as exc:
            raise CoreDeadError(f"data-parallel engine core {core} of {self.size}: {exc}") \
                from exc

    def output_time(self) -> float | None:
        return self._output_time

    # ---- utility calls ------------------------------------------------------------------

    def call_async(self, method: str, *args: Any) -> Future:
        if method in _FAN_OUT:
            return self._gather(method)
        core = 0
        if method in _BY_PREFIX:
            holder = self.placer.holder(self.block_hashes(list(args[0]), args[1]))
            if holder is None and method == "is_prefix_cached":
                return _resolved(False)
            core = 0 if holder is None else holder
        return self._guard(core, lambda: self.cores[core].call_async(method, *args))

    def _gather(self, method: str) -> Future:
        """Ask every core; one future of the combined answers (the first error, if any)."""
        ask = "get_stats" if method == "get_core_stats" else method
        futures = [self._guard(i, lambda c=c: c.call_async(ask))
                   for i, c in enumerate(self.cores)]
        combined: Future = Future()
        combined.set_running_or_notify_cancel()
        left = [len(futures)]

        def done(_: Future) -> None:
            left[0] -= 1
            if left[0]:
                return
            error = next((f.exception() for f in futures if f.exception() is not None), None)
            if error is not None:
                combined.set_exception(error)
                return
            results = [f.result() for f in futures]
            combined.set_result(sum_stats(results) if method == "get_stats"
                                else results if method == "get_core_stats" else None)

        for future in futures:
            future.add_done_callback(done)
        return combined

    def call(self, method: str, *args: Any) -> Any:
        future = self.call_async(method, *args)
        while not future.done():
            self._receive(self.poll_s)
        return future.result()

    def has_pending_calls(self) -> bool:
        return any(core.has_pending_calls() for core in self.cores)

    # ---- liveness and lifecycle ---------------------------------------------------------

    def busy_for(self) -> float:
        return max(core.busy_for() for core in self.cores)

    def is_alive(self) -> bool:
        return all(core.is_alive() for core in self.cores)

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            self._waker_w.send(b"x")

    def shutdown(self) -> None:
        """Stop every core (in parallel). Idempotent."""
        if self._closed:
            return
        self._closed = True
        with ThreadPoolExecutor(self.size) as pool:
            list(pool.map(lambda core: core.shutdown(), self.cores))
        self._waker_r.close()
        self._waker_w.close()


def _resolved(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
