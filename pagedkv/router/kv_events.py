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

No backend can hold the router's event loop: the SUB socket takes messages of at most
`max_message_bytes` (ZMQ's MAXMSGSIZE: a larger one is never read into memory; ZMQ drops the
connection, which is counted, pagedkv_router:kv_event_disconnects, and logged, and reconnects),
and a batch is applied in slices of at most `SLICE_BLOCKS` blocks, yielding to the loop between
slices once `SLICE_S` has passed. What the index keeps of a backend is bounded whatever its
events say (prefix_index.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

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

# A step's batch is kilobytes (a 128k-token prefill: under 1 MB with its token ids); 4 MiB
# decodes in some 50 ms.
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
SLICE_BLOCKS = 1024  # blocks applied between checks of the clock
SLICE_S = 0.02  # the loop is given back once a batch has held it this long
RECONNECT_S = 0.1  # ZMQ's own reconnection interval


def sliced(event: BlockStored | BlockRemoved,
           size: int = SLICE_BLOCKS) -> Iterator[BlockStored | BlockRemoved]:
    """`event` as events of at most `size` blocks each, applied in turn to the same effect
    (a stored chain's later slices hang off the block before them; token ids and extra keys
    are cut with their blocks)."""
    hashes = event.block_hashes
    if len(hashes) <= size:
        yield event
        return
    if isinstance(event, BlockRemoved):
        for i in range(0, len(hashes), size):
            yield msgspec.structs.replace(event, block_hashes=hashes[i:i + size])
        return
    whole = len(event.token_ids) == event.block_size * len(hashes)
    for i in range(0, len(hashes), size):
        j = i + size
        bs = event.block_size
        yield msgspec.structs.replace(
            event, block_hashes=hashes[i:j],
            parent_block_hash=event.parent_block_hash if i == 0 else hashes[i - 1],
            token_ids=event.token_ids[i * bs:j * bs] if whole else [],
            extra_keys=event.extra_keys[i:j] if event.extra_keys else event.extra_keys)


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


async def apply_batch_sliced(index: PrefixIndex, backend: str, batch: KVEventBatch,
                             model: str | None = None,
                             chains: TokenChains | None = None) -> int:
    """`apply_batch`, a slice of at most SLICE_BLOCKS blocks at a time, giving the event loop
    back between slices once SLICE_S has passed since it last had it; returns the events."""
    held_since = time.monotonic()
    for event in batch.events:
        parts = sliced(event) if isinstance(event, (BlockStored, BlockRemoved)) else [event]
        for part in parts:
            apply_batch(index, backend, KVEventBatch(ts=batch.ts, events=[part]), model, chains)
            if time.monotonic() - held_since >= SLICE_S:
                await asyncio.sleep(0)
                held_since = time.monotonic()
    return len(batch.events)


class KVEventSubscriber:
    """Reads `backend.events_endpoint` into the router's index until cancelled. The socket
    belongs to `context` (one per router, so two routers can share a process); it takes
    messages of at most `max_message_bytes`."""

    def __init__(self, router: Router, backend: Backend, context: zmq.asyncio.Context,
                 topic: bytes = b"",
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        if not backend.events_endpoint:
            raise ValueError(f"backend {backend.name} has no KV-event endpoint")
        if max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be >= 1, got {max_message_bytes!r}")
        self.router = router
        self.backend = backend
        self.context = context
        self.topic = topic
        self.max_message_bytes = max_message_bytes
        self.last_seq: int | None = None

    async def handle(self, frames: list[bytes]) -> None:
        """Apply one message (a malformed or oversized one is counted, logged and skipped)."""
        name = self.backend.name
        if len(frames) != 3:
            logger.warning("KV event from %s has %d frames, expected 3", name, len(frames))
            return
        size = sum(len(frame) for frame in frames)
        if size > self.max_message_bytes:  # MAXMSGSIZE bounds each frame; this, the message
            self.router.metrics.kv_events_dropped.labels(name).inc()
            logger.warning("KV event message of %d bytes from %s dropped (limit %d)", size,
                           name, self.max_message_bytes)
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
        applied = await apply_batch_sliced(self.router.index, name, batch,
                                           self.backend.only_model,
                                           self.router.token_chains_for(self.backend))
        self.router.metrics.kv_events.labels(name).inc(applied)

    async def run(self) -> None:
        socket = self.context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        socket.setsockopt(zmq.SUBSCRIBE, self.topic)
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        watch = asyncio.create_task(self._watch(socket, monitor))
        socket.connect(self.backend.events_endpoint)
        try:
            while True:
                await self.handle(await socket.recv_multipart())
        finally:
            watch.cancel()
            socket.disable_monitor()
            monitor.close(linger=0)
            socket.close(linger=0)

    async def _watch(self, socket: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        """Count and log each lost connection to the publisher, and connect again: ZMQ
        reconnects by itself after a network error but never after a protocol error (a
        message over MAXMSGSIZE)."""
        name, endpoint = self.backend.name, self.backend.events_endpoint
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            self.router.metrics.kv_event_disconnects.labels(name).inc()
            logger.warning("KV-event connection to %s lost (the backend went away, or sent a "
                           "message over %d bytes); reconnecting", name,
                           self.max_message_bytes)
            with contextlib.suppress(zmq.ZMQError):  # already gone after a protocol error
                socket.disconnect(endpoint)
            await asyncio.sleep(RECONNECT_S)
            socket.connect(endpoint)
