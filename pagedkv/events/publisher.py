"""ZmqEventPublisher: sends each engine step's KV events over a ZMQ PUB socket, off the hot path.

The engine thread calls `publish(events)`; a background thread owns the sockets (ZMQ sockets are
not thread-safe) and sends `(topic, seq, payload)` messages in the wire format of
`pagedkv.events.wire`. As vLLM's `ZmqEventPublisher`: the PUB socket binds a wildcard, ipc:// or
inproc:// endpoint and connects to any other (an indexer that binds), and an optional ROUTER
replay socket answers a request `[identity, b"", start_seq]` with one message
`[identity, b"", topic, seq, payload]` per buffered batch from `start_seq` on, then
`[identity, b"", b"", END_SEQ, b""]`. A full queue drops the batch (a router sees the gap in
`seq`) rather than block a step. `to_wire_events` turns the block pool's events into wire events.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable

import zmq

from pagedkv.events import wire
from pagedkv.events.config import KVEventsConfig
from pagedkv.kv import events as pool_events

logger = logging.getLogger(__name__)

_STOP = object()
_POLL_S = 0.05  # how long the thread waits for a batch before looking at replay requests


def to_wire_events(events: Iterable[pool_events.KVCacheEvent],
                   medium: str = wire.MEDIUM_DEVICE) -> list[wire.KVCacheEvent]:
    """The block pool's (or a tier's) events as wire events tagged with `medium`, each with
    its KV cache group (0 for a single-group cache) and stored ones with the group's kind and
    window, as vLLM 0.32 publishes them (`group_idx=0`, `kv_cache_spec_kind="full_attention"`
    for a plain model)."""
    out: list[wire.KVCacheEvent] = []
    for event in events:
        if isinstance(event, pool_events.BlockStored):
            stored = wire.block_stored(list(event.block_hashes), event.parent_block_hash,
                                       list(event.token_ids), event.block_size, medium,
                                       group_idx=event.group_idx, extra_keys=event.extra_keys)
            stored.kv_cache_spec_kind = event.kv_cache_spec_kind
            stored.kv_cache_spec_sliding_window = event.kv_cache_spec_sliding_window
            out.append(stored)
        elif isinstance(event, pool_events.BlockRemoved):
            out.append(wire.BlockRemoved(block_hashes=list(event.block_hashes), medium=medium,
                                         group_idx=event.group_idx))
        elif isinstance(event, pool_events.AllBlocksCleared):
            out.append(wire.AllBlocksCleared())
        else:
            raise TypeError(f"not a KV cache event: {event!r}")
    return out


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard (`*`, `::`) and ipc/inproc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Opens its sockets in its own thread; `publish` never blocks.

    `endpoint` (and `replay_endpoint`) after construction are the addresses really bound (a `*`
    port resolved), so tests and routers on the same host can connect to them; a connected
    endpoint stays as given. `close()` sends what is queued and stops the thread; idempotent.
    """

    def __init__(self, endpoint: str, topic: str = "", max_queue_size: int = 100_000,
                 replay_endpoint: str | None = None, buffer_steps: int = 10_000,
                 hwm: int = 100_000, data_parallel_rank: int = 0) -> None:
        self.topic = topic.encode("utf-8")
        self.data_parallel_rank = data_parallel_rank
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._hwm = hwm
        self._seq = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.num_dropped = 0
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise ValueError(f"cannot open the KV event publisher at {endpoint!r} (replay "
                             f"{replay_endpoint!r}): {self._error}") from self._error

    def publish(self, events: list[wire.KVCacheEvent]) -> None:
        """Queue one batch (one engine step's events). Empty lists are not sent."""
        if not events or not self._thread.is_alive():
            return
        batch = wire.KVEventBatch(ts=time.time(), events=events,
                                  data_parallel_rank=self.data_parallel_rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1

    def _open(self, context: zmq.Context) -> tuple[zmq.Socket, zmq.Socket | None]:
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 1000)
        pub.set_hwm(self._hwm)
        replay = None
        try:
            if is_bind_endpoint(self.endpoint):
                pub.bind(self.endpoint)
                self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                replay = context.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            pub.close(0)
            if replay is not None:
                replay.close(0)
            raise
        return pub, replay

    def _run(self) -> None:
        context = zmq.Context()
        try:
            pub, replay = self._open(context)
        except zmq.ZMQError as e:
            self._error = e
            context.term()
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                if replay is not None:
                    while replay.poll(0):
                        self._serve_replay(replay)
                try:
                    batch = self._queue.get(timeout=_POLL_S if replay is not None else None)
                except queue.Empty:
                    continue
                if batch is _STOP:
                    break
                payload = wire.encode_batch(batch)
                pub.send_multipart([self.topic, wire.encode_seq(self._seq), payload])
                self._buffer.append((self._seq, payload))
                self._seq += 1
        except Exception:  # never take the engine down; the router sees the seq gap
            logger.exception("KV event publisher stopped")
        finally:
            pub.close()
            if replay is not None:
                replay.close(0)
            context.term()

    def _serve_replay(self, replay: zmq.Socket) -> None:
        """Answer one replay request with the buffered batches from its sequence number on."""
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("invalid KV event replay request: %d frames", len(frames))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                replay.send_multipart([identity, b"", self.topic, wire.encode_seq(seq), payload])
        replay.send_multipart([identity, b"", b"", wire.encode_seq(wire.END_SEQ), b""])

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout=5)


def make_event_publisher(config: KVEventsConfig,
                         data_parallel_rank: int = 0) -> ZmqEventPublisher | None:
    """The publisher `config` asks for, open and running, its batches stamped with
    `data_parallel_rank`; None when events are disabled."""
    if not config.enabled:
        return None
    return ZmqEventPublisher(config.endpoint, config.topic, max_queue_size=config.max_queue_size,
                             replay_endpoint=config.replay_endpoint,
                             buffer_steps=config.buffer_steps, hwm=config.hwm,
                             data_parallel_rank=data_parallel_rank)
