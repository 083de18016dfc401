"""KVTransfer: an engine core's side of prefill/decode disaggregation (transfer_config.py says
what the roles and connectors are), answered as utility calls between the core's steps.

Producer, once a prefill request (max_tokens 1) finished:
  `start_handoff(token_ids, cache_salt, ...)` starts, on the transfer thread, a job that waits
  until the store's saver has written the request's blocks (they were queued by the steps that
  computed them), then, for the push connector, reads them back from the host staging tier and
  pushes them to the consumer; for the store connector, counts the leading blocks the shared
  tiers hold. `poll_handoff(job)` gives the job's outcome once done: the transferred blocks'
  hashes, tokens, bytes and seconds. The engine steps on meanwhile.
Consumer, before a decode request is admitted:
  `describe()` gives what the params are checked against (model identity, KV format, block
  size); `held_blocks(token_ids, cache_salt, n)` how many of the prompt's first `n` blocks the
  push tier holds (the server waits, bounded, for all of them before submitting). The store's
  lookup then loads them like any store hit: exactly the blocks that arrived intact, under this
  engine's keys; the rest are computed.
"""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pagedkv.store.tiered import BlockMeta, TieredKVStore
from pagedkv.store.transfer_config import KVTransferConfig
from pagedkv.store.transfer_push import PushReceiverTier, PushSender

logger = logging.getLogger(__name__)

SAVE_POLL_S = 0.002


@dataclass
class HashablePrompt:
    """A prompt as the block hasher reads it (`pagedkv.kv.hashing.HashableRequest`)."""

    all_token_ids: list[int]
    cache_salt: str | None
    lora_name: str | None = None


class KVTransfer:
    """See the module docstring. `hasher`: the KV cache manager's block hasher; `kv_format`:
    what the KV bytes mean (the cache dtype tag, also part of the store's identity)."""

    def __init__(self, config: KVTransferConfig, store: TieredKVStore, hasher: Any,
                 kv_format: str, num_groups: int = 1) -> None:
        """`num_groups`: the KV cache groups' count (their blocks are stored per group)."""
        self.config = config
        self.num_groups = num_groups
        self.store = store
        self.hasher = hasher
        self.kv_format = kv_format
        self.receiver = next((t for t in store.tiers if isinstance(t, PushReceiverTier)), None)
        self.sender = PushSender(config.extra("layer_groups")) \
            if config.is_push and config.is_producer else None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kv-transfer")
        self._job_ids = itertools.count()
        self._jobs: dict[int, Future] = {}
        self.num_handoffs = 0
        self.bytes_sent = 0

    # ---- identity -------------------------------------------------------------------------
    def describe(self) -> dict:
        """What a consumer checks a request's params against (and a producer names)."""
        return {"engine_id": self.config.engine_id, "kv_role": self.config.kv_role,
                "kv_connector": self.config.kv_connector,
                "model_identity": self.store.identity.hex(), "kv_format": self.kv_format,
                "block_size": self.store.block_size, "block_bytes": self.store.block_bytes,
                "kv_ip": self.config.kv_ip, "kv_port": self.config.kv_port}

    def block_hashes(self, token_ids: list[int], cache_salt: str | None) -> list[bytes]:
        """The chained hashes of the prompt's full blocks (as the KV cache manager makes them)."""
        return self.hasher(HashablePrompt(list(token_ids), cache_salt), [])

    # ---- producer -------------------------------------------------------------------------
    def start_handoff(self, token_ids: list[int], cache_salt: str | None,
                      remote_host: str | None = None, remote_port: int | None = None) -> int:
        """Start handing the prompt's computed blocks to the transport; the job's id."""
        if not self.config.is_producer:
            raise ValueError(f"kv_role {self.config.kv_role!r} does not prefill for others")
        hashes = self.block_hashes(token_ids, cache_salt)
        bs = self.store.block_size
        metas = [BlockMeta(h, hashes[i - 1] if i else None, tuple(token_ids[i * bs:(i + 1) * bs]),
                           g if self.store.grouped else None)
                 for i, h in enumerate(hashes) for g in range(self.num_groups)]
        targets = ([(remote_host, int(remote_port))] if remote_host and remote_port
                   else list(self.config.consumers))
        job_id = next(self._job_ids)
        self._jobs[job_id] = self._thread.submit(self._handoff, metas, self.store.save_ticket(),
                                                 targets)
        return job_id

    def poll_handoff(self, job_id: int) -> dict | None:
        """The job's outcome once done (then forgotten), else None. A failed job transferred
        nothing (its consumer recomputes)."""
        future = self._jobs.get(job_id)
        if future is None:
            raise ValueError(f"no kv transfer job {job_id!r}")
        if not future.done():
            return None
        del self._jobs[job_id]
        try:
            return future.result()
        except Exception as exc:  # a consumer gone (zmq.Again), a store failure
            logger.warning("kv transfer: a handoff failed (%r); its decode recomputes the "
                           "prompt", exc)
            return {"block_hashes": [], "num_tokens": 0, "transfer_bytes": 0,
                    "transfer_seconds": 0.0}

    def _handoff(self, metas: list[BlockMeta], ticket: int,
                 targets: list[tuple[str, int]]) -> dict:
        """The transfer thread's job (module docstring)."""
        start = time.perf_counter()
        deadline = time.monotonic() + self.config.transfer_timeout_s
        while not self.store.saved_through(ticket) and time.monotonic() < deadline:
            time.sleep(SAVE_POLL_S)
        if self.sender is None:  # leading prompt blocks (group 0's) the shared tiers hold
            present = self._in_shared_tiers(metas)
            first = [p for m, p in zip(metas, present, strict=True) if not m.group_idx]
            num_hashes = first.index(False) if False in first else len(first)
            num_blocks = sum(present[:num_hashes * self.num_groups])
            sent = num_blocks * self.store.block_bytes
        else:
            pushed = self._held(metas)
            payloads = self.store.load(pushed)
            num_blocks, sent = len(payloads), 0
            keys = [self.store.key(m.block_hash, m.group_idx) for m in pushed[:num_blocks]]
            for target in targets:
                sent += self.sender.push(target, keys, payloads, self.store.block_bytes)
            last = pushed[num_blocks - 1].block_hash if num_blocks else None
            hashes = [m.block_hash for m in metas if not m.group_idx]
            num_hashes = hashes.index(last) + 1 if num_blocks else 0
        self.num_handoffs += 1
        self.bytes_sent += sent
        return {"block_hashes": [m.block_hash.hex() for m in metas if not m.group_idx][:num_hashes],
                "num_blocks": num_blocks, "num_tokens": num_hashes * self.store.block_size,
                "transfer_bytes": sent, "transfer_seconds": round(time.perf_counter() - start, 6)}

    def _held(self, metas: list[BlockMeta]) -> list[BlockMeta]:
        """The blocks of `metas` this engine's store holds to push: the leading ones with one
        KV cache group; with several, every one held (a sliding group keeps only the blocks
        its window reaches, and the consumer's hit rule asks for no others)."""
        present = self.store.holds([(m.block_hash, m.group_idx) for m in metas])
        if self.store.grouped:
            return [m for m, held in zip(metas, present, strict=True) if held]
        return metas[:present.index(False) if False in present else len(metas)]

    def _in_shared_tiers(self, metas: list[BlockMeta]) -> list[bool]:
        """Whether the shared tiers (all but host RAM) hold each block of `metas`."""
        keys = [self.store.key(m.block_hash, m.group_idx) for m in metas]
        present = [False] * len(keys)
        for tier in self.store.tiers:
            if tier.name != "host" and keys:
                present = [p or f for p, f in zip(present, tier.contains_many(keys), strict=True)]
        return present

    # ---- consumer -------------------------------------------------------------------------
    def held_blocks(self, token_ids: list[int], cache_salt: str | None, num_hashes: int,
                    num_blocks: int) -> int:
        """How many blocks of the prompt's first `num_hashes` block hashes (every KV cache
        group's) the push tier holds, up to `num_blocks` (the store connector: `num_blocks`;
        its tiers are looked up at admission)."""
        if self.receiver is None:
            return num_blocks
        hashes = self.block_hashes(token_ids, cache_salt)[:num_hashes]
        keys = [self.store.key(h, g if self.store.grouped else None)
                for h in hashes for g in range(self.num_groups)]
        return min(num_blocks, sum(self.receiver.contains_many(keys)))

    def stats(self) -> dict:
        """Handoffs and bytes sent (producer), blocks and bytes received (consumer)."""
        out = {"handoffs": self.num_handoffs, "bytes_sent": self.bytes_sent}
        if self.receiver is not None:
            out.update(bytes_received=self.receiver.bytes_received,
                       blocks_received=self.receiver.blocks_received,
                       blocks_dropped=self.receiver.blocks_dropped,
                       blocks_held=self.receiver.num_blocks)
        return out

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
        if self.sender is not None:
            self.sender.close()
