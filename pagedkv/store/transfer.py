"""KVTransfer: an engine core's side of prefill/decode disaggregation (transfer_config.py says
what the roles and connectors are), answered as utility calls between the core's steps. Each
tensor-parallel rank moves its own slice of the blocks (transfer_rank.py); this side asks every
rank through the executor (`ranks`: one call per rank, results in rank order; with one process,
the runner's own) and combines their answers. No call waits on a tier or the wire: the engine
steps on while the ranks' transfer threads work.

Producer, once a prefill request (max_tokens 1) finished:
  `start_handoff(token_ids, cache_salt, ...)` starts a job on every rank (`RankTransfer.start`:
  each waits until its own saved-through watermark covers the request's blocks, then pushes
  its slice, or counts what the shared tiers hold). `poll_handoff(job)` gives the outcome once
  every rank's is in: the leading blocks every rank transferred (hashes, tokens, blocks), the
  bytes of all ranks and the slowest rank's seconds. The answer is sent only then, so it never
  precedes a rank's durability. `abandon_handoff(job)` forgets a job its server stopped
  waiting for; a job nobody polled for JOB_TTL_S is forgotten too (a server task cancelled
  with its client), so abandoned jobs never pile up.
Consumer, before a decode request is admitted:
  `describe()` gives what the params are checked against (model identity, KV format, block
  size); `held_blocks(token_ids, cache_salt, n)` how many of the prompt's first `n` blocks every
  rank's push tier holds or the device's prefix cache already has (params replayed after a
  first load, or a block another request sharing the prefix took from the push tier: nothing
  more will arrive for those); the server waits, bounded, for all of them before submitting. The
  store's lookup then loads them like any store hit: exactly the blocks that arrived intact on
  every rank, under this engine's keys; the rest are computed.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedkv.store.tiered import BlockMeta
from pagedkv.store.transfer_config import KVTransferConfig
from pagedkv.store.transfer_push import PushSender
from pagedkv.store.transfer_rank import RankTransfer

logger = logging.getLogger(__name__)

RANK_POLL_S = 0.005  # a job's ranks are asked at most this often (one collective each time)
RankCalls = Callable[..., list[Any]]  # (method path below a rank's runner, *args) -> per rank
RANK_TRANSFER = "kv_connector.transfer"  # where a rank's RankTransfer lives
JOB_TTL_S = 120.0  # a job not polled for this long is forgotten (its server stopped asking)


@dataclass
class HashablePrompt:
    """A prompt as the block hasher reads it (`pagedkv.kv.hashing.HashableRequest`)."""

    all_token_ids: list[int]
    cache_salt: str | None
    lora_name: str | None = None


@dataclass
class _Job:
    """A handoff started on every rank: its blocks, when its ranks were last asked and each
    rank's outcome once in (a rank forgets a job once it has answered for it)."""

    metas: list[BlockMeta]
    outcomes: list[dict | None]
    asked: float = 0.0


class KVTransfer:
    """See the module docstring. `local`: rank 0's side (its store's identity describes the
    engine); `ranks`: calls a method of every rank's runner; `hasher`: the KV cache manager's
    block hasher; `kv_format`: what the KV bytes mean (the cache dtype tag, also part of the
    store's identity)."""

    def __init__(self, config: KVTransferConfig, local: RankTransfer, hasher: Any,
                 kv_format: str, ranks: RankCalls, num_groups: int = 1,
                 device_holds: Callable[[bytes, int], bool] | None = None) -> None:
        """`num_groups`: the KV cache groups' count (their blocks are stored per group);
        `device_holds(block_hash, group)`: whether the device's prefix cache has that block."""
        self.config = config
        self.num_groups = num_groups
        self.local = local
        self.store = local.store
        self.hasher = hasher
        self.kv_format = kv_format
        self.ranks = ranks
        self.device_holds = device_holds
        self.receiver = local.receiver
        self._job_ids = itertools.count()
        self._jobs: dict[int, _Job] = {}
        self.num_handoffs = 0
        self.bytes_sent = 0

    @property
    def sender(self) -> PushSender | None:
        """Rank 0's push sender (None unless a push producer)."""
        return self.local.sender

    # ---- identity -------------------------------------------------------------------------
    def describe(self) -> dict:
        """What a consumer checks a request's params against (and a producer names)."""
        return {"engine_id": self.config.engine_id, "kv_role": self.config.kv_role,
                "kv_connector": self.config.kv_connector,
                "model_identity": self.store.identity.hex(), "kv_format": self.kv_format,
                "block_size": self.store.block_size, "block_bytes": self.store.block_bytes,
                "kv_ip": self.config.kv_ip, "kv_port": self.config.kv_port,
                "num_groups": self.num_groups}

    def block_hashes(self, token_ids: list[int], cache_salt: str | None) -> list[bytes]:
        """The chained hashes of the prompt's full blocks (as the KV cache manager makes them)."""
        return self.hasher(HashablePrompt(list(token_ids), cache_salt), [])

    # ---- producer -------------------------------------------------------------------------
    def start_handoff(self, token_ids: list[int], cache_salt: str | None,
                      remote_host: str | None = None, remote_port: int | None = None) -> int:
        """Start handing the prompt's computed blocks to the transport on every rank; the
        job's id."""
        if not self.config.is_producer:
            raise ValueError(f"kv_role {self.config.kv_role!r} does not prefill for others")
        hashes = self.block_hashes(token_ids, cache_salt)
        bs = self.store.block_size
        metas = [BlockMeta(h, hashes[i - 1] if i else None, tuple(token_ids[i * bs:(i + 1) * bs]),
                           g if self.store.grouped else None)
                 for i, h in enumerate(hashes) for g in range(self.num_groups)]
        targets = ([(remote_host, int(remote_port))] if remote_host and remote_port
                   else list(self.config.consumers))
        self._forget_stale(time.monotonic() - JOB_TTL_S)
        job_id = next(self._job_ids)
        tickets = self.ranks(f"{RANK_TRANSFER}.start", job_id, metas, targets)
        self._jobs[job_id] = _Job(metas, [None] * len(tickets), time.monotonic())
        return job_id

    def poll_handoff(self, job_id: int) -> dict | None:
        """The job's outcome once every rank's is in (then forgotten), else None. The ranks are
        asked at most every RANK_POLL_S; a rank that failed transferred nothing, and only the
        blocks every rank transferred count (the consumer recomputes the rest)."""
        job = self._jobs.get(job_id)
        if job is None:
            raise ValueError(f"no kv transfer job {job_id!r}")
        now = time.monotonic()
        if now - job.asked < RANK_POLL_S:
            return None
        job.asked = now
        answers = self.ranks(f"{RANK_TRANSFER}.poll", job_id)
        job.outcomes = [mine if mine is not None else answer
                        for mine, answer in zip(job.outcomes, answers, strict=True)]
        if any(o is None for o in job.outcomes):
            return None
        del self._jobs[job_id]
        return self._combine(job.metas, job.outcomes)

    def abandon_handoff(self, job_id: int) -> None:
        """Forget a job its server stopped waiting for, on every rank (a rank's transfer still
        ends in bounded time; its outcome is dropped)."""
        if self._jobs.pop(job_id, None) is not None:
            self.ranks(f"{RANK_TRANSFER}.forget", job_id)

    def _forget_stale(self, cutoff: float) -> None:
        """Abandon every job last polled before `cutoff`."""
        for job_id in [j for j, job in self._jobs.items() if job.asked < cutoff]:
            logger.warning("kv transfer: handoff job %d was not polled for %.0f s; forgotten",
                           job_id, JOB_TTL_S)
            self.abandon_handoff(job_id)

    @property
    def num_jobs(self) -> int:
        """Handoff jobs started and not yet answered or abandoned."""
        return len(self._jobs)

    def _combine(self, metas: list[BlockMeta], outcomes: list[dict]) -> dict:
        num_hashes = min(o["num_hashes"] for o in outcomes)
        sent = sum(o["transfer_bytes"] for o in outcomes)
        self.num_handoffs += 1
        self.bytes_sent += sent
        hashes = [m.block_hash.hex() for m in metas if not m.group_idx]
        return {"block_hashes": hashes[:num_hashes],
                "num_blocks": min(o["num_blocks"] for o in outcomes),
                "num_tokens": num_hashes * self.store.block_size, "transfer_bytes": sent,
                "transfer_seconds": max(o["transfer_seconds"] for o in outcomes),
                "durable": all(o["durable"] for o in outcomes)}

    # ---- consumer -------------------------------------------------------------------------
    def held_blocks(self, token_ids: list[int], cache_salt: str | None, num_hashes: int,
                    num_blocks: int) -> int:
        """How many blocks of the prompt's first `num_hashes` block hashes (every KV cache
        group's) are here: held by every rank's push tier, or already in the device's prefix
        cache; up to `num_blocks` (the store connector: `num_blocks`; its tiers are looked up
        at admission)."""
        if self.receiver is None:
            return num_blocks
        hashes = self.block_hashes(token_ids, cache_salt)[:num_hashes]
        pairs = [(h, g) for h in hashes for g in range(self.num_groups)]
        on_device = [self.device_holds is not None and self.device_holds(h, g) for h, g in pairs]
        if all(on_device):
            return num_blocks
        masks = self.ranks(f"{RANK_TRANSFER}.held_mask", hashes, self.num_groups)
        here = [dev or all(mask[i] for mask in masks) for i, dev in enumerate(on_device)]
        return min(num_blocks, sum(here))

    def stats(self) -> dict:
        """Handoffs, bytes sent and handoff jobs pending (producer), blocks and bytes received by
        rank 0 (consumer)."""
        out = {"handoffs": self.num_handoffs, "bytes_sent": self.bytes_sent,
               "jobs_pending": self.num_jobs}
        if self.receiver is not None:
            out.update(bytes_received=self.receiver.bytes_received,
                       blocks_received=self.receiver.blocks_received,
                       blocks_dropped=self.receiver.blocks_dropped,
                       blocks_held=self.receiver.num_blocks)
        return out

    def close(self) -> None:
        """Nothing of its own to close: every rank's transfer closes with its store."""
        self._jobs.clear()
