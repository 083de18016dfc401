"""RankTransfer: one tensor-parallel rank's side of prefill/decode disaggregation (transfer.py is
the engine core's, which asks every rank through the executor and combines their answers).

A rank's store holds its own KV heads under keys naming its rank and the group's size
(factory.py), so every rank moves its own slice of each block: no rank's bytes pass through
another's, and the engine's steps (which hold the executor's command channel) never wait on a
transfer.

Producer: `start(job_id, metas, targets)` takes this rank's save ticket (the store's saves
queued so far: on every rank the steps that computed the request's blocks ran before this call)
and starts, on the rank's transfer thread, a job that waits until the rank's saved-through
watermark (`TieredKVStore.saves_written`) reaches the ticket, then, for the push connector,
reads the blocks back from the host staging tier and pushes them to the consumer's rank of the
same index (`port + rank`); for the store connector, counts the leading blocks the shared tiers
hold. The job is bounded from `start`: its save wait and its push end within
`transfer_timeout_s` (a push that starts at that deadline still gets PUSH_GRACE_S to queue its
blocks; one not queued by then fails: its decode recomputes), however long it queued behind
other jobs. `poll(job_id)` gives its outcome once done (the rank's watermark included).
Consumer: `held_mask(hashes, num_groups)` says which blocks of `hashes` this rank's push tier holds
(a consumer of N ranks listens on `kv_port` .. `kv_port + N - 1`).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from pagedkv.store.tiered import BlockMeta, TieredKVStore
from pagedkv.store.transfer_config import KVTransferConfig
from pagedkv.store.transfer_push import PushReceiverTier, PushSender

logger = logging.getLogger(__name__)

SAVE_POLL_S = 0.002
PUSH_GRACE_S = 0.5  # a push starting at its job's deadline still gets this long to be queued


def failed_outcome() -> dict:
    """A rank's outcome when it transferred nothing (its consumer recomputes)."""
    return {"num_hashes": 0, "num_blocks": 0, "transfer_bytes": 0, "transfer_seconds": 0.0,
            "durable": False, "ticket": 0, "watermark": 0}


class RankTransfer:
    """See the module docstring. `rank`: this rank's index in its tensor-parallel group (0
    for one process)."""

    def __init__(self, config: KVTransferConfig, store: TieredKVStore, rank: int = 0) -> None:
        self.config = config
        self.store = store
        self.rank = rank
        self.receiver = next((t for t in store.tiers if isinstance(t, PushReceiverTier)), None)
        self.sender = PushSender(config.extra("layer_groups")) \
            if config.is_push and config.is_producer else None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"kv-transfer-rank{rank}")
        self._jobs: dict[int, Future] = {}

    # ---- producer -------------------------------------------------------------------------
    def start(self, job_id: int, metas: list[BlockMeta], targets: list[tuple[str, int]]) -> int:
        """Start handing this rank's slice of `metas` to the transport (pushed to each target's
        port + this rank); this rank's save ticket."""
        ticket = self.store.save_ticket()
        deadline = time.monotonic() + self.config.transfer_timeout_s
        targets = [(host, int(port) + self.rank) for host, port in targets]
        self._jobs[job_id] = self._thread.submit(self._handoff, metas, ticket, targets,
                                                 deadline)
        return ticket

    def poll(self, job_id: int) -> dict | None:
        """The job's outcome once done (then forgotten), else None; a job this rank never
        started, or one that failed, transferred nothing."""
        future = self._jobs.get(job_id)
        if future is None:
            return failed_outcome()
        if not future.done():
            return None
        del self._jobs[job_id]
        try:
            return future.result()
        except Exception as exc:  # a consumer gone (zmq.Again), a store failure
            logger.warning("kv transfer: rank %d's handoff failed (%r); its decode recomputes "
                           "the prompt", self.rank, exc)
            return failed_outcome()

    def forget(self, job_id: int) -> None:
        """Drop a job nobody will poll (cancelled if it has not started)."""
        future = self._jobs.pop(job_id, None)
        if future is not None:
            future.cancel()

    @property
    def num_jobs(self) -> int:
        return len(self._jobs)

    def _handoff(self, metas: list[BlockMeta], ticket: int, targets: list[tuple[str, int]],
                 deadline: float) -> dict:
        """The transfer thread's job, to end by `deadline` (module docstring)."""
        start = time.perf_counter()
        while self.store.saves_written() < ticket and time.monotonic() < deadline:
            time.sleep(SAVE_POLL_S)
        watermark = self.store.saves_written()
        if self.sender is None:
            num_hashes, num_blocks, sent = self._in_shared_tiers(metas)
        else:
            push_by = max(deadline, time.monotonic() + PUSH_GRACE_S)
            num_hashes, num_blocks, sent = self._push(metas, targets, push_by)
        return {"num_hashes": num_hashes, "num_blocks": num_blocks, "transfer_bytes": sent,
                "transfer_seconds": round(time.perf_counter() - start, 6),
                "durable": watermark >= ticket, "ticket": ticket, "watermark": watermark}

    def _push(self, metas: list[BlockMeta], targets: list[tuple[str, int]], deadline: float
              ) -> tuple[int, int, int]:
        """Push the blocks this rank's staging holds, queued by `deadline` (else zmq.Again):
        (leading hashes, blocks, bytes sent)."""
        pushed = self._held(metas)
        payloads = self.store.load(pushed)
        num_blocks, sent = len(payloads), 0
        keys = [self.store.key(m.block_hash, m.group_idx) for m in pushed[:num_blocks]]
        for target in targets:
            sent += self.sender.push(target, keys, payloads, self.store.block_bytes, deadline)
        if not num_blocks:
            return 0, 0, sent
        hashes = [m.block_hash for m in metas if not m.group_idx]
        return hashes.index(pushed[num_blocks - 1].block_hash) + 1, num_blocks, sent

    def _held(self, metas: list[BlockMeta]) -> list[BlockMeta]:
        """The blocks of `metas` this rank's store holds to push: the leading ones with one
        KV cache group; with several, every one held (a sliding group keeps only the blocks
        its window reaches, and the consumer's hit rule asks for no others)."""
        present = self.store.holds([(m.block_hash, m.group_idx) for m in metas])
        if self.store.grouped:
            return [m for m, held in zip(metas, present, strict=True) if held]
        return metas[:present.index(False) if False in present else len(metas)]

    def _in_shared_tiers(self, metas: list[BlockMeta]) -> tuple[int, int, int]:
        """(leading hashes whose every group's block the shared tiers (all but host RAM) hold,
        those blocks, their bytes)."""
        keys = [self.store.key(m.block_hash, m.group_idx) for m in metas]
        present = [False] * len(keys)
        for tier in self.store.tiers:
            if tier.name != "host" and keys:
                present = [p or f for p, f in zip(present, tier.contains_many(keys), strict=True)]
        first = [p for m, p in zip(metas, present, strict=True) if not m.group_idx]
        num_groups = len(metas) // max(1, len(first))  # metas: every group's, block-major
        num_hashes = first.index(False) if False in first else len(first)
        num_blocks = sum(present[:num_hashes * num_groups])
        return num_hashes, num_blocks, num_blocks * self.store.block_bytes

    # ---- consumer -------------------------------------------------------------------------
    def held_mask(self, hashes: list[bytes], num_groups: int) -> list[bool]:
        """Whether this rank's push tier holds each block of `hashes`, every KV cache group's
        (hash-major)."""
        if self.receiver is None:
            return [True] * (len(hashes) * num_groups)
        keys = [self.store.key(h, g if self.store.grouped else None)
                for h in hashes for g in range(num_groups)]
        return self.receiver.contains_many(keys)

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
        if self.sender is not None:
            self.sender.close()
