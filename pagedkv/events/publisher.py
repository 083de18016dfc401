"""ZmqEventPublisher: sends each engine step's KV events over a ZMQ PUB socket, off the hot path.

The engine thread calls `publish(events)`; a background thread owns the socket (ZMQ sockets are
not thread-safe) and sends `(topic, seq, payload)` messages in the wire format of
`pagedkv.events.wire`. A full queue drops the batch (a router sees the gap in `seq`) rather
than block a step. `to_wire_events` turns the block pool's events into wire events for a tier.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable

import zmq

from pagedkv.events import wire
from pagedkv.events.config import KVEventsConfig
from pagedkv.kv import events as pool_events

logger = logging.getLogger(__name__)

_STOP = object()


def to_wire_events(events: Iterable[pool_events.KVCacheEvent],
                   medium: str = wire.MEDIUM_DEVICE) -> list[wire.KVCacheEvent]:
    """The block pool's (or a tier's) events as wire events tagged with `medium`."""
    out: list[wire.KVCacheEvent] = []
    for event in events:
        if isinstance(event, pool_events.BlockStored):
            out.append(wire.BlockStored(
                block_hashes=list(event.block_hashes), parent_block_hash=event.parent_block_hash,
                token_ids=list(event.token_ids), block_size=event.block_size, medium=medium))
        elif isinstance(event, pool_events.BlockRemoved):
            out.append(wire.BlockRemoved(block_hashes=list(event.block_hashes), medium=medium))
        elif isinstance(event, pool_events.AllBlocksCleared):
            out.append(wire.AllBlocksCleared())
        else:
            raise TypeError(f"not a KV cache event: {event!r}")
    return out


class ZmqEventPublisher:
    """Binds a PUB socket at `endpoint` in its own thread; `publish` never blocks.

    `endpoint` after construction is the address really bound (a `*` port resolved), so tests
    and routers on the same host can connect to it. `close()` sends what is queued and stops
    the thread; it is idempotent.
    """

    def __init__(self, endpoint: str, topic: str = "", max_queue: int = 10_000) -> None:
        self.topic = topic.encode("utf-8")
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._seq = 0
        self._bound = threading.Event()
        self._error: BaseException | None = None
        self.endpoint = endpoint
        self.num_dropped = 0
        self._thread = threading.Thread(target=self._run, args=(endpoint,),
                                        name="kv-event-publisher", daemon=True)
        self._thread.start()
        self._bound.wait()
        if self._error is not None:
            raise ValueError(f"cannot bind the KV event publisher to {endpoint!r}: "
                             f"{self._error}") from self._error

    def publish(self, events: list[wire.KVCacheEvent]) -> None:
        """Queue one batch (one engine step's events). Empty lists are not sent."""
        if not events or not self._thread.is_alive():
            return
        batch = wire.KVEventBatch(ts=time.time(), events=events)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1

    def _run(self, endpoint: str) -> None:
        context = zmq.Context()
        socket = context.socket(zmq.PUB)
        socket.setsockopt(zmq.LINGER, 1000)
        try:
            socket.bind(endpoint)
            self.endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._error = e
            socket.close(0)
            context.term()
            self._bound.set()
            return
        self._bound.set()
        try:
            while True:
                batch = self._queue.get()
                if batch is _STOP:
                    break
                socket.send_multipart([self.topic, wire.encode_seq(self._seq),
                                       wire.encode_batch(batch)])
                self._seq += 1
        except Exception:  # never take the engine down; the router sees the seq gap
            logger.exception("KV event publisher stopped")
        finally:
            socket.close()
            context.term()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout=5)


def make_event_publisher(config: KVEventsConfig) -> ZmqEventPublisher | None:
    """The publisher `config` asks for, bound and running; None when events are disabled."""
    if not config.enabled:
        return None
    return ZmqEventPublisher(config.endpoint, config.topic)
