"""The KV connector seam between the engine and the tiered store (vLLM's KVConnectorBase_V1
split), with asynchronous loads: the engine thread never waits on a tier while it has other
work.

Scheduler side (`StoreConnectorScheduler`, called by the Scheduler; no tier I/O but lookups):
  1. `get_num_new_matched_tokens(request, n)`: after the device prefix hit of `n` tokens and
     before allocation, how many more prompt tokens the store holds (consecutive full blocks by
     chained hash, the first miss stops; the last prompt token is always computed). The answer
     is cached on the request (`request.kv_store_lookup`) until it is admitted, so a request
     that waits several steps costs one tier lookup (for Redis, one round trip), not one a step.
  2. `update_state_after_alloc(request, n, num_external)`: once blocks are allocated for those
     tokens, plan their load (a `LoadJob`); the scheduler parks the request, holding its blocks,
     in WAITING_FOR_REMOTE_KVS.
  3. `build_connector_meta(out, requests)`: the step's new load jobs, the jobs of requests that
     ended while loading (cancelled), the full blocks this step computes (to be saved), and
     whether the worker should wait for a load (the step has nothing else to run).
  4. `take_finished_loads()`: at the next `schedule()`, the loads the worker applied, as
     (request, tokens loaded intact). The scheduler then sets `num_computed_tokens` to the hit
     plus those tokens, caches only those blocks in the prefix cache, and runs the request:
     blocks whose bytes never arrived (a failed, corrupt or timed-out load) are recomputed, and
     are never served as prefix-cache hits.
Worker side (`StoreConnectorWorker`, called by the ModelRunner at the start of a step):
  - `start_load_kv(meta, kv_cache)`: start the step's new jobs on the store's loader threads
    (each reads its blocks from the tiers into host rows, pinned on CUDA); when the step runs
    nothing else, wait for one (at most IDLE_WAIT_S: the engine loop stays responsive); then copy every finished job's rows into its device blocks and
    report it. Device blocks are written only here, on the engine thread, for jobs not
    cancelled: a block freed when its request ended is never written afterwards. A job that
    raised, or ran past `load_timeout_s`, reports 0 blocks.
  - `save_kv(meta, kv_cache)`: after the forward pass, copy the saved blocks out (one gather;
    on CUDA an asynchronous copy into pinned memory) and hand them to the store's saver thread,
    which writes them to every tier: the step never waits for a tier.
Blocks cross the seam as rows of raw bytes (`KVCache.read_blocks` / `write_blocks`: the KV
cache owns its layout).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedkv.kv.hashing import event_extra_keys
from pagedkv.store.payload import Payload, copy_payload_into, host_rows, rows_to_host
from pagedkv.store.tiered import BlockMeta, TieredKVStore

if TYPE_CHECKING:
    import torch

    from pagedkv.kv.manager import KVCacheManager
    from pagedkv.model.kv_cache import KVCache
    from pagedkv.sched.output import SchedulerOutput
    from pagedkv.sched.request import Request

logger = logging.getLogger(__name__)

DEFAULT_LOAD_TIMEOUT_S = 10.0
# An idle step waits at most this long for a load, so the engine loop still takes new requests
# and aborts while a slow load runs.
IDLE_WAIT_S = 0.05


@dataclass
class LoadJob:
    """Load `metas` (consecutive blocks of one request) into device blocks `block_ids`."""

    job_id: int
    request_id: str
    block_ids: list[int]
    metas: list[BlockMeta]


@dataclass
class StoreConnectorMetadata:
    """One step's store work for the worker side."""

    loads: list[LoadJob] = field(default_factory=list)
    cancelled_job_ids: list[int] = field(default_factory=list)
    saves: list[tuple[int, BlockMeta]] = field(default_factory=list)  # (device block id, meta)
    wait_for_load: bool = False  # nothing else runs this step: wait for a load to finish


class FinishedLoads:
    """The worker side's report to the scheduler side: (job id, blocks loaded intact) of each
    applied job. Both sides run on the engine thread of one process, so this is a list."""

    def __init__(self) -> None:
        self._done: list[tuple[int, int]] = []

    def post(self, job_id: int, num_blocks: int) -> None:
        self._done.append((job_id, num_blocks))

    def take(self) -> list[tuple[int, int]]:
        done, self._done = self._done, []
        return done


def _block_metas(request: Request, hashes: list[bytes], start: int, end: int,
                 block_size: int) -> list[BlockMeta]:
    tokens = request.all_token_ids
    return [BlockMeta(hashes[i], hashes[i - 1] if i > 0 else None,
                      tuple(tokens[i * block_size:(i + 1) * block_size]),
                      event_extra_keys(request.cache_salt, request.lora_name, i == 0))
            for i in range(start, end)]


class StoreConnectorScheduler:
    """The scheduler's side: lookups, load plans and their outcome, save lists."""

    def __init__(self, store: TieredKVStore, kv_cache_manager: KVCacheManager,
                 finished: FinishedLoads) -> None:
        self.store = store
        self.kv = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.finished = finished
        self._job_ids = itertools.count()
        self._jobs: dict[int, tuple[LoadJob, Request]] = {}  # started, outcome not yet taken
        self._job_of_request: dict[str, int] = {}
        self._new_loads: list[LoadJob] = []
        self._cancelled: list[int] = []
        self.num_lookups = 0
        self.num_loaded_tokens = 0
        self.num_failed_load_tokens = 0

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens after the first `num_computed_tokens` that the store can provide. Looks the
        tiers up once per admission (cached on the request: blocks [first, first + n) held)."""
        bs = self.block_size
        start = num_computed_tokens // bs
        end = (request.num_tokens - 1) // bs
        if end <= start:
            return 0
        cached = request.kv_store_lookup
        if cached is None or cached[0] > start:
            hashes = self.kv.update_block_hashes(request)
            cached = request.kv_store_lookup = (start, self.store.lookup(hashes[start:end]))
            self.num_lookups += 1
        first, num_blocks = cached
        return max(0, min(first + num_blocks, end) - start) * bs

    def update_state_after_alloc(self, request: Request, num_computed_tokens: int,
                                 num_external_tokens: int) -> None:
        """Plan the load of the `num_external_tokens` tokens after `num_computed_tokens` into
        the request's blocks just allocated for them (started by the next step's worker)."""
        request.kv_store_lookup = None
        bs = self.block_size
        start = num_computed_tokens // bs
        end = start + num_external_tokens // bs
        hashes = self.kv.get_block_hashes(request.request_id)
        block_ids = self.kv.get_block_ids(request.request_id)[start:end]
        job = LoadJob(next(self._job_ids), request.request_id, block_ids,
                      _block_metas(request, hashes, start, end, bs))
        self._jobs[job.job_id] = (job, request)
        self._job_of_request[request.request_id] = job.job_id
        self._new_loads.append(job)

    def take_finished_loads(self) -> list[tuple[Request, int]]:
        """(request, tokens loaded intact, a prefix of the planned ones) of each load the worker
        applied since the last call; cancelled loads are left out."""
        out = []
        for job_id, num_blocks in self.finished.take():
            entry = self._jobs.pop(job_id, None)
            if entry is None:
                continue
            job, request = entry
            del self._job_of_request[job.request_id]
            loaded = num_blocks * self.block_size
            self.num_loaded_tokens += loaded
            self.num_failed_load_tokens += len(job.block_ids) * self.block_size - loaded
            out.append((request, loaded))
        return out

    def request_finished(self, request: Request) -> None:
        """`request` ended while its load was in flight: cancel the load (its blocks are freed
        now; the worker will not write them)."""
        job_id = self._job_of_request.pop(request.request_id, None)
        if job_id is not None:
            del self._jobs[job_id]
            self._cancelled.append(job_id)

    @property
    def num_pending_loads(self) -> int:
        return len(self._jobs)

    def build_connector_meta(self, out: SchedulerOutput, requests: dict[str, Request]
                             ) -> StoreConnectorMetadata | None:
        """The step's store work (drains the planned loads and cancellations); None when there
        is none."""
        saves = self._saves(out, requests)
        if not (saves or self._jobs or self._cancelled):
            return None
        meta = StoreConnectorMetadata(self._new_loads, self._cancelled, saves,
                                      wait_for_load=bool(self._jobs) and not out.scheduled)
        self._new_loads, self._cancelled = [], []
        return meta

    def _saves(self, out: SchedulerOutput, requests: dict[str, Request]
               ) -> list[tuple[int, BlockMeta]]:
        """The blocks that become full and computed in this step."""
        bs = self.block_size
        saves: list[tuple[int, BlockMeta]] = []
        for scheduled in out.scheduled:
            first = scheduled.start_pos // bs
            end = (scheduled.start_pos + scheduled.num_new_tokens) // bs
            request = requests.get(scheduled.request_id)
            if request is None or end <= first:
                continue
            hashes = self.kv.update_block_hashes(request)
            end = min(end, len(hashes))
            table = scheduled.block_table
            saves.extend((table[i], m) for i, m in zip(
                range(first, end), _block_metas(request, hashes, first, end, bs), strict=True)
                if table[i] != 0)
        return saves


class StoreConnectorWorker:
    """The model runner's side: runs loads in the background, applies them, starts saves."""

    def __init__(self, store: TieredKVStore, finished: FinishedLoads, *, pin_memory: bool,
                 load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S) -> None:
        self.store = store
        self.finished = finished
        self.pin_memory = pin_memory
        self.load_timeout_s = load_timeout_s
        self._pending: dict[int, tuple[LoadJob, Future, float]] = {}  # job id -> (job, rows, deadline)
        self.num_failed_loads = 0  # jobs that raised or timed out

    # ---- loads ------------------------------------------------------------------------------
    def start_load_kv(self, meta: StoreConnectorMetadata | None, kv_cache: KVCache) -> None:
        """Start the step's loads and apply the finished ones (mutates the KV cache's blocks of
        finished, not cancelled jobs); see the module docstring."""
        if meta is None:
            return
        for job_id in meta.cancelled_job_ids:
            entry = self._pending.pop(job_id, None)
            if entry is not None:  # a queued read never starts; a running one is dropped
                entry[1].cancel()
        deadline = time.monotonic() + self.load_timeout_s
        for job in meta.loads:
            self._pending[job.job_id] = (job, self.store.load_async(job.metas, self._to_rows),
                                         deadline)
        if meta.wait_for_load and self._pending:
            self._wait_for_any()
        self._apply_finished(kv_cache)

    def _to_rows(self, payloads: list[Payload]) -> torch.Tensor:
        """The loaded payloads as host rows (loader thread; pinned on CUDA)."""
        rows = host_rows(len(payloads), self.store.block_bytes, self.pin_memory)
        for row, payload in zip(rows, payloads, strict=True):
            copy_payload_into(row, payload)
        return rows

    def _wait_for_any(self) -> None:
        first_deadline = min(deadline for _, _, deadline in self._pending.values())
        concurrent.futures.wait([f for _, f, _ in self._pending.values()],
                                timeout=min(IDLE_WAIT_S, max(0.0, first_deadline - time.monotonic())),
                                return_when=concurrent.futures.FIRST_COMPLETED)

    def _apply_finished(self, kv_cache: KVCache) -> None:
        now = time.monotonic()
        for job_id, (job, future, deadline) in list(self._pending.items()):
            if future.done() or now >= deadline:
                del self._pending[job_id]
                self.finished.post(job_id, self._apply(job, future, kv_cache))

    def _apply(self, job: LoadJob, future: Future, kv_cache: KVCache) -> int:
        """Copy a finished job's rows into its device blocks; the number of blocks loaded."""
        if not future.done():
            future.cancel()
            self.num_failed_loads += 1
            logger.warning("kv store: a load of %d blocks timed out after %.1f s; they are "
                           "recomputed", len(job.block_ids), self.load_timeout_s)
            return 0
        try:
            rows = future.result()
            if rows.shape[0]:
                kv_cache.write_blocks(job.block_ids[:rows.shape[0]], rows)
            return rows.shape[0]
        except Exception:  # a store failure costs time, never a request
            self.num_failed_loads += 1
            logger.exception("kv store: a load failed; its blocks are recomputed")
            return 0

    # ---- saves ------------------------------------------------------------------------------
    def save_kv(self, meta: StoreConnectorMetadata | None, kv_cache: KVCache) -> None:
        """Copy the step's newly computed full blocks out and queue them for saving."""
        if meta is None or not meta.saves:
            return
        rows = kv_cache.read_blocks([b for b, _ in meta.saves])  # a copy: blocks get reused
        host, ready = rows_to_host(rows, self.pin_memory)

        def payloads() -> list[Payload]:  # on the saver thread
            if ready is not None:
                ready.synchronize()
            return list(host)

        self.store.save_async([m for _, m in meta.saves], payloads)
