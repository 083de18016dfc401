"""Subscribing to a backend's KV events (ZMQ SUB) and applying them to the prefix index.

Each message is three frames, `(topic, seq, payload)` (see `pagedkv.events.wire`).
`BlockStored` adds its hashes to the backend's entries on its medium (never expiring), under
the model the backend serves (`Backend.only_model`),
`BlockRemoved` drops them, `AllBlocksCleared` drops all of the backend's entries. For a backend
whose hashes are not the router's (a vLLM server), each event is also applied under the router's
own keys of its token ids (token_chains.py), so prompts match it by tokens; a router that knows no
block size yet takes the events' (`Router.adopt_block_size`). A jump in the
sequence numbers is a missed batch: counted (pagedkv_router:kv_event_gaps) and logged; the
index stays as it is (the router's own TTL'd record and the next events repair it).
"""

from __future__ import annotations

import logging

import msgspec
import zmq
import zmq.asyncio

from pagedkv.events.wire import (
    MEDIUM_DEVICE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    decode_seq,
)
from pagedkv.router.backend import Backend
from pagedkv.router.prefix_index import PrefixIndex
from pagedkv.router.router import Router
from pagedkv.router.token_chains import TokenChains

logger = logging.getLogger("pagedkv.router")


def apply_batch(index: PrefixIndex, backend: str, batch: KVEventBatch,
                model: str | None = None, chains: TokenChains | None = None) -> int:
    """Apply one batch's events, in order, to `backend`'s entries of `model` (the model the
    backend serves: events carry no model identity); returns how many. With `chains` each
    event is applied by the hashes it carries and by the router's keys of its token ids
    (mutating `chains`' map of the backend).

    A backend with KV cache groups (a model mixing attention types) reports each group's
    blocks: only group 0's (its full-attention group, whose prefix bounds every hit) are
    indexed, so one group's eviction never hides a block another still holds."""
    for event in batch.events:
        if getattr(event, "group_idx", None):  # AllBlocksCleared has none
            continue
        if isinstance(event, BlockStored):
            medium = event.medium or MEDIUM_DEVICE
            index.store(backend, event.block_hashes, medium, ttl_s=None, model=model)
            if chains is not None:
                index.store(backend, chains.stored(backend, event), medium, ttl_s=None,
                            model=model)
        elif isinstance(event, BlockRemoved):  # vLLM may leave medium None: its device pool
            medium = event.medium or MEDIUM_DEVICE
            index.remove(backend, event.block_hashes, medium, model=model)
            if chains is not None:
                index.remove(backend, chains.removed(backend, event), medium, model=model)
        elif isinstance(event, AllBlocksCleared):
            index.clear(backend)
            if chains is not None:
                chains.clear(backend)
    return len(batch.events)


class KVEventSubscriber:
    """Reads `backend.events_endpoint` into the router's index until cancelled. The socket
    belongs to `context` (one per router, so two routers can share a process)."""

    def __init__(self, router: Router, backend: Backend, context: zmq.asyncio.Context,
                 topic: bytes = b"") -> None:
        if not backend.events_endpoint:
            raise ValueError(f"backend {backend.name} has no KV-event endpoint")
        self.router = router
        self.backend = backend
        self.context = context
        self.topic = topic
        self.last_seq: int | None = None

    def handle(self, frames: list[bytes]) -> None:
        """Apply one message (a malformed one is logged and skipped)."""
        name = self.backend.name
        if len(frames) != 3:
            logger.warning("KV event from %s has %d frames, expected 3", name, len(frames))
            return
        try:
            seq = decode_seq(frames[1])
            batch = decode_batch(frames[2])
        except (ValueError, msgspec.DecodeError) as exc:
            logger.warning("malformed KV event from %s: %s", name, exc)
            return
        if self.last_seq is not None and seq != self.last_seq + 1:
            self.router.metrics.kv_event_gaps.labels(name).inc()
            logger.warning("KV events from %s jumped from seq %d to %d", name, self.last_seq, seq)
        self.last_seq = seq
        if self.router.hash_settings is None:
            sizes = [e.block_size for e in batch.events if isinstance(e, BlockStored)]
            if sizes:
                self.router.adopt_block_size(sizes[0])
        applied = apply_batch(self.router.index, name, batch, self.backend.only_model,
                              self.router.token_chains_for(self.backend))
        self.router.metrics.kv_events.labels(name).inc(applied)

    async def run(self) -> None:
        socket = self.context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, self.topic)
        socket.connect(self.backend.events_endpoint)
        try:
            while True:
                self.handle(await socket.recv_multipart())
        finally:
            socket.close(linger=0)
