"""The KV connector seam between the engine and the tiered store (vLLM's KVConnectorBase_V1
split), with asynchronous loads: the engine thread never waits on a tier while it has other
work.

Scheduler side (`StoreConnectorScheduler`, called by the Scheduler; no tier I/O but lookups):
  1. `get_num_new_matched_tokens(request, n)`: after the device prefix hit of `n` tokens and
     before allocation, how many more prompt tokens the store holds (consecutive full blocks by
     chained hash, the first miss stops; the last prompt token is always computed). With KV
     cache groups every group's blocks are stored under keys naming the group, and the answer
     follows each group's hit rule (kv/hit_rule.py: a sliding group needs only the blocks its
     window reaches back to), as do the blocks loaded and the tokens a partial load serves. The answer
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

Tensor parallel: the scheduler side runs once, on rank 0, over rank 0's store; every rank has
its own worker side and store (its KV heads, under keys that name its rank: factory.py) and
gets the same metadata each step. A load is applied when every rank is done with it, each
rank writing the fewest blocks any rank loaded (one all-gather of the ranks' outcomes a step
while loads are pending), so the ranks' KV caches hold the same tokens and rank 0 reports
that count: a block missing from one rank's store is recomputed on all.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedkv.kv.hashing import event_extra_keys
from pagedkv.kv.hit_rule import longest_servable_prefix
from pagedkv.store.lookup import store_matched_tokens
from pagedkv.store.payload import Payload, copy_payload_into, host_rows, rows_to_host
from pagedkv.store.tiered import BlockMeta, TieredKVStore
from pagedkv.store.timing import DEFAULT_LOAD_TIMEOUT_S, IDLE_WAIT_S

if TYPE_CHECKING:
    import torch

    from pagedkv.kv.manager import KVCacheManager
    from pagedkv.store.interfaces import BlockRows, RankGroup, ScheduledStep, StoreRequest

logger = logging.getLogger(__name__)


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

    @property
    def num_saves(self) -> int:
        """Blocks this step copies out to the store (a step's shape for `pagedkv simulate`)."""
        return len(self.saves)


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


def _block_meta(request: StoreRequest, hashes: list[bytes], i: int, block_size: int,
                group_idx: int | None = None) -> BlockMeta:
    return BlockMeta(hashes[i], hashes[i - 1] if i > 0 else None,
                     tuple(request.all_token_ids[i * block_size:(i + 1) * block_size]), group_idx,
                     event_extra_keys(request.cache_salt, request.lora_name, i == 0))


def _block_metas(request: StoreRequest, hashes: list[bytes], start: int, end: int,
                 block_size: int) -> list[BlockMeta]:
    return [_block_meta(request, hashes, i, block_size) for i in range(start, end)]


@dataclass
class _PlannedLoad:
    """A started load as the scheduler side keeps it: with KV cache groups, the (block, group)
    of each of the job's metas and the blocks [start, end) it was planned to serve."""

    job: LoadJob
    request: StoreRequest
    blocks: list[tuple[int, int]] | None = None
    start: int = 0
    end: int = 0


class StoreConnectorScheduler:
    """The scheduler's side: lookups, load plans and their outcome, save lists."""

    def __init__(self, store: TieredKVStore, kv_cache_manager: KVCacheManager,
                 finished: FinishedLoads) -> None:
        self.store = store
        self.kv = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        # KV cache groups: each group's blocks needed before a hit point (None: all of them;
        # hit_rule.py); None with one group.
        self.window_blocks: list[int | None] | None = getattr(kv_cache_manager,
                                                              "window_blocks", None)
        self.finished = finished
        self._job_ids = itertools.count()
        self._jobs: dict[int, _PlannedLoad] = {}  # started, outcome not yet taken
        self._job_of_request: dict[str, int] = {}
        self._new_loads: list[LoadJob] = []
        self._cancelled: list[int] = []
        self.num_lookups = 0
        self.num_loaded_tokens = 0
        self.num_failed_load_tokens = 0

    def get_num_new_matched_tokens(self, request: StoreRequest, num_computed_tokens: int) -> int:
        """Tokens after the first `num_computed_tokens` that the store can provide. Looks the
        tiers up once per admission (`store_matched_tokens`)."""
        tokens, looked_up = store_matched_tokens(request, num_computed_tokens, self.kv,
                                                 self._lookup)
        self.num_lookups += looked_up
        return tokens

    def _lookup(self, hashes: Sequence[bytes]) -> int:
        """Of `hashes` (the blocks after the device hit), how many leading blocks the tiers can
        serve: consecutive ones with one group; with KV cache groups, by each group's hit rule
        (a sliding group needs only the blocks its window reaches back to from the hit point)."""
        if self.window_blocks is None:
            return self.store.lookup(hashes)
        num_groups = len(self.window_blocks)
        present = self.store.holds([(h, g) for h in hashes for g in range(num_groups)])
        return longest_servable_prefix(0, len(hashes), self.window_blocks,
                                       lambda g, i: present[i * num_groups + g])

    def _group_blocks(self, start: int, end: int) -> list[tuple[int, int]]:
        """(block, group) of every block a hit up to `end` needs from the tiers, block-major."""
        return [(i, g) for i in range(start, end) for g, need in enumerate(self.window_blocks)
                if need is None or i >= end - need]

    def update_state_after_alloc(self, request: StoreRequest, num_computed_tokens: int,
                                 num_external_tokens: int) -> None:
        """Plan the load of the `num_external_tokens` tokens after `num_computed_tokens` into
        the request's blocks just allocated for them (started by the next step's worker)."""
        request.kv_store_lookup = None
        bs = self.block_size
        start = num_computed_tokens // bs
        end = start + num_external_tokens // bs
        hashes = self.kv.get_block_hashes(request.request_id)
        if self.window_blocks is None:
            job = LoadJob(next(self._job_ids), request.request_id,
                          self.kv.get_block_ids(request.request_id)[start:end],
                          _block_metas(request, hashes, start, end, bs))
            self._jobs[job.job_id] = _PlannedLoad(job, request)
        else:  # each group's blocks into that group's table
            blocks = self._group_blocks(start, end)
            tables = self.kv.get_group_block_ids(request.request_id)
            job = LoadJob(next(self._job_ids), request.request_id,
                          [tables[g][i] for i, g in blocks],
                          [_block_meta(request, hashes, i, bs, g) for i, g in blocks])
            self._jobs[job.job_id] = _PlannedLoad(job, request, blocks, start, end)
        self._job_of_request[request.request_id] = job.job_id
        self._new_loads.append(job)

    def take_finished_loads(self) -> list[tuple[StoreRequest, int]]:
        """(request, tokens loaded intact, a prefix of the planned ones) of each load the worker
        applied since the last call; cancelled loads are left out."""
        out = []
        for job_id, num_blocks in self.finished.take():
            planned = self._jobs.pop(job_id, None)
            if planned is None:
                continue
            del self._job_of_request[planned.job.request_id]
            loaded, wanted = self._loaded_tokens(planned, num_blocks)
            self.num_loaded_tokens += loaded
            self.num_failed_load_tokens += wanted - loaded
            out.append((planned.request, loaded))
        return out

    def _loaded_tokens(self, planned: _PlannedLoad, num_blocks: int) -> tuple[int, int]:
        """(tokens the job's first `num_blocks` intact blocks serve, tokens it was planned to
        serve); with KV cache groups by each group's hit rule over the blocks that arrived."""
        bs = self.block_size
        if planned.blocks is None:
            return num_blocks * bs, len(planned.job.block_ids) * bs
        arrived = set(planned.blocks[:num_blocks])
        end = longest_servable_prefix(planned.start, planned.end, self.window_blocks,
                                      lambda g, i: (i, g) in arrived)
        return (end - planned.start) * bs, (planned.end - planned.start) * bs

    def request_finished(self, request: StoreRequest) -> None:
        """`request` ended while its load was in flight: cancel the load (its blocks are freed
        now; the worker will not write them)."""
        job_id = self._job_of_request.pop(request.request_id, None)
        if job_id is not None:
            del self._jobs[job_id]
            self._cancelled.append(job_id)

    @property
    def num_pending_loads(self) -> int:
        return len(self._jobs)

    def build_connector_meta(self, out: ScheduledStep, requests: dict[str, StoreRequest]
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

    def _saves(self, out: ScheduledStep, requests: dict[str, StoreRequest]
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
            if scheduled.group_block_tables is None:
                table = scheduled.block_table
                saves.extend((table[i], m) for i, m in zip(
                    range(first, end), _block_metas(request, hashes, first, end, bs),
                    strict=True) if table[i] != 0)
                continue
            for g, table in enumerate(scheduled.group_block_tables):  # every group's blocks
                saves.extend((table[i], _block_meta(request, hashes, i, bs, g))
                             for i in range(first, end) if table[i] != 0)
        return saves


def agreed_outcomes(per_rank: list[dict[int, int]]) -> dict[int, int]:
    """The jobs every rank is done with, each with the fewest blocks any rank loaded."""
    common = set(per_rank[0]).intersection(*per_rank[1:])
    return {job_id: min(outcomes[job_id] for outcomes in per_rank) for job_id in sorted(common)}


class StoreConnectorWorker:
    """The model runner's side: runs loads in the background, applies them, starts saves.
    `group`: this runner's tensor-parallel group (loads applied by agreement; only rank 0
    posts to `finished`), None for one process. `transfer`: this rank's side of prefill/decode
    disaggregation (store/transfer_rank.py), None without it."""

    def __init__(self, store: TieredKVStore, finished: FinishedLoads, *, pin_memory: bool,
                 load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
                 group: RankGroup | None = None, transfer: Any = None) -> None:
        self.store = store
        self.transfer = transfer
        self.finished = finished
        self.pin_memory = pin_memory
        self.load_timeout_s = load_timeout_s
        self.group = group if group is not None and group.size > 1 else None
        self._pending: dict[int, tuple[LoadJob, Future, float]] = {}  # job id -> (job, rows, deadline)
        self.num_failed_loads = 0  # jobs that raised or timed out

    # ---- loads ------------------------------------------------------------------------------
    def start_load_kv(self, meta: StoreConnectorMetadata | None, kv_cache: BlockRows) -> None:
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

    def _apply_finished(self, kv_cache: BlockRows) -> None:
        """Apply (and report) every job this rank, or with tensor parallelism every rank, is
        done with: finished, failed or past its deadline (mutates the KV cache, `_pending`).
        The all-gather runs on every rank alike: `_pending` holds the same jobs on each."""
        if not self._pending:
            return
        outcomes = self._local_outcomes()
        if self.group is not None:
            outcomes = agreed_outcomes(self.group.all_gather_objects(outcomes))
        for job_id, num_blocks in outcomes.items():
            job, future, _ = self._pending.pop(job_id)
            applied = self._apply(job, future, kv_cache, num_blocks)
            if self.group is None or self.group.is_driver:
                self.finished.post(job_id, applied)

    def _local_outcomes(self) -> dict[int, int]:
        """Blocks loaded (0: failed or timed out) of each pending job this rank is done with."""
        now = time.monotonic()
        outcomes = {}
        for job_id, (_, future, deadline) in self._pending.items():
            if future.done():
                failed = future.cancelled() or future.exception() is not None
                outcomes[job_id] = 0 if failed else future.result().shape[0]
            elif now >= deadline:
                outcomes[job_id] = 0
        return outcomes

    def _apply(self, job: LoadJob, future: Future, kv_cache: BlockRows, num_blocks: int) -> int:
        """Copy the first `num_blocks` loaded rows of a job into its device blocks; the number
        of blocks written."""
        if not future.done():
            future.cancel()
            self.num_failed_loads += 1
            logger.warning("kv store: a load of %d blocks timed out after %.1f s; they are "
                           "recomputed", len(job.block_ids), self.load_timeout_s)
            return 0
        if future.cancelled() or future.exception() is not None:
            self.num_failed_loads += 1
            logger.error("kv store: a load failed; its blocks are recomputed",
                         exc_info=None if future.cancelled() else future.exception())
            return 0
        try:
            if num_blocks:
                kv_cache.write_blocks(job.block_ids[:num_blocks], future.result()[:num_blocks])
            return num_blocks
        except Exception:  # a store failure costs time, never a request
            self.num_failed_loads += 1
            logger.exception("kv store: writing loaded blocks failed; they are recomputed")
            return 0

    def close(self) -> None:
        """Close this rank's transfer side, then its store (queued saves written first)."""
        if self.transfer is not None:
            self.transfer.close()
        self.store.close()

    # ---- saves ------------------------------------------------------------------------------
    def save_kv(self, meta: StoreConnectorMetadata | None, kv_cache: BlockRows) -> None:
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
