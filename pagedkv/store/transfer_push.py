"""The direct transport of prefill/decode disaggregation: a producer pushes KV blocks over ZMQ
(PUSH -> PULL) to a consumer, which holds them as a store tier until their request loads them.

Wire: one multipart message per chunk of a batch of blocks: a JSON header (`keys`: each block's
store key in hex, `checksums`: xxh3-64 of key + payload as in codec.py, `chunk`, `chunks`,
`block_bytes`) and one frame holding slice `chunk` of every block's bytes, back to back. A
block's bytes start with layer 0's K and V (`KVCache.read_blocks`), so slice i of `chunks` is
a layer group: the consumer gets the first layers' bytes while the producer still sends the
rest, and the producer's engine steps on meanwhile (the push runs on its own thread). A push
is queued only to a connected consumer, at most SEND_QUEUE_MESSAGES messages deep: a consumer
that is gone makes the push fail after SEND_TIMEOUT_MS, or at the push's deadline if sooner
(its decode then recomputes), never grows the producer's memory, and its socket is closed (at
most MAX_SOCKETS are kept, the least recently used closed first).

The consumer keeps a block only when all its slices arrived and its checksum matches its key;
blocks are kept under the producer's keys, which name the model identity (weights, KV format,
layout, block size) and the chained hash (cache salt included): a consumer of another model or
format, or a request with another salt, never finds them. Held blocks expire after `hold_s`
and the oldest go first past `capacity_bytes`, which also bounds the slices of blocks still
arriving (the oldest incomplete blocks go first); a load takes a block out (it then lives in
the device cache). A header that cannot be true (a block size other than this engine's or past
the capacity, a chunk outside its count, slices that disagree with their block's first) costs
its message, never memory.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import zmq

from pagedkv.store.codec import block_checksum
from pagedkv.store.payload import Payload, payload_buffer
from pagedkv.store.tier import KVTier

logger = logging.getLogger(__name__)

POLL_MS = 50  # the receiver thread checks for close this often
SEND_TIMEOUT_MS = 2000  # a send that cannot be queued within this (peer gone, queue full) fails
SEND_RETRY_S = 0.002  # a send the socket cannot take yet is tried again this often
SEND_QUEUE_MESSAGES = 8  # messages queued for a consumer at most: a dead one costs no memory
MAX_SOCKETS = 64  # consumer sockets a sender keeps open (least recently used closed first)
MAX_CHUNKS = 1024  # slices a block may be sent in


def chunk_bounds(block_bytes: int, chunks: int) -> list[tuple[int, int]]:
    """[start, end) of each of `chunks` near-equal slices of a block's bytes."""
    chunks = max(1, min(chunks, block_bytes))
    edges = [block_bytes * i // chunks for i in range(chunks + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


def _send(sock: zmq.Socket, frames: list[bytes], deadline: float) -> None:
    """Queue one message on `sock`, retrying until `deadline` (`time.monotonic()`; a send
    past it is tried once); zmq.Again when the socket could not take it by then."""
    while True:
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return
        except zmq.Again:
            if time.monotonic() >= deadline:
                raise
            time.sleep(SEND_RETRY_S)


class PushSender:
    """The producer's side: one PUSH socket per consumer address. Not thread-safe: one thread
    (the transfer thread) pushes."""

    def __init__(self, layer_groups: int) -> None:
        self.layer_groups = layer_groups
        self._context = zmq.Context()
        self._sockets: OrderedDict[tuple[str, int], zmq.Socket] = OrderedDict()

    @property
    def num_sockets(self) -> int:
        return len(self._sockets)

    def _drop(self, address: tuple[str, int]) -> None:
        sock = self._sockets.pop(address, None)
        if sock is not None:
            sock.close(linger=0)

    def _socket(self, address: tuple[str, int]) -> zmq.Socket:
        sock = self._sockets.get(address)
        if sock is not None:
            self._sockets.move_to_end(address)
        else:
            while len(self._sockets) >= MAX_SOCKETS:
                self._drop(next(iter(self._sockets)))
            sock = self._context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, SEND_QUEUE_MESSAGES)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a connected consumer
            sock.connect(f"tcp://{address[0]}:{address[1]}")
            self._sockets[address] = sock
        return sock

    def push(self, address: tuple[str, int], keys: Sequence[bytes],
             payloads: Sequence[Payload], block_bytes: int,
             deadline: float | None = None) -> int:
        """Queue `payloads` (one block each, stored under `keys`) for `address`, chunked by
        layer group; the bytes sent. Raises zmq.Again when the consumer cannot take them
        within SEND_TIMEOUT_MS a chunk, or by `deadline` (`time.monotonic()`) when given
        (then a chunk due past it is tried once)."""
        if not keys:
            return 0
        buffers = [payload_buffer(p) for p in payloads]
        checksums = [block_checksum(k, b) for k, b in zip(keys, buffers, strict=True)]
        bounds = chunk_bounds(block_bytes, self.layer_groups)
        sock = self._socket(address)
        sent = 0
        try:
            for i, (lo, hi) in enumerate(bounds):
                header = json.dumps({"keys": [k.hex() for k in keys], "checksums": checksums,
                                     "chunk": i, "chunks": len(bounds),
                                     "block_bytes": block_bytes}).encode()
                body = b"".join(bytes(b[lo:hi]) for b in buffers)
                by = time.monotonic() + SEND_TIMEOUT_MS / 1000
                _send(sock, [header, body], by if deadline is None else min(by, deadline))
                sent += len(body)
        except zmq.Again:
            self._drop(address)  # a consumer that cannot take them keeps no socket here
            raise
        return sent

    def close(self) -> None:
        self._sockets.clear()
        self._context.destroy(linger=0)  # closes every socket it made


class _Partial:
    """A block whose slices are still arriving."""

    def __init__(self, block_bytes: int, chunks: int, checksum: int) -> None:
        self.data = bytearray(block_bytes)
        self.chunks = chunks
        self.missing = set(range(chunks))
        self.checksum = checksum
        self.since = time.monotonic()

    def fits(self, block_bytes: int, chunks: int, checksum: int) -> bool:
        """Whether a slice of this header belongs to this block as its first slice said."""
        return (len(self.data), self.chunks, self.checksum) == (block_bytes, chunks, checksum)


def _int(header: dict, name: str, low: int, high: int) -> int:
    """header[name], an int in [low, high]; ValueError otherwise."""
    value = header.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"push header {name}={value!r} is not in [{low}, {high}]")
    return value


class PushReceiverTier(KVTier):
    """The consumer's side: binds a PULL socket on `host:port` and holds the blocks pushed to
    it (see the module docstring). Writes from the engine's own store are ignored."""

    name = "push"
    medium = "CPU"

    def __init__(self, host: str, port: int, capacity_bytes: int, hold_s: float,
                 block_bytes: int | None = None) -> None:
        """`block_bytes`: the only block size accepted (None: any up to `capacity_bytes`)."""
        super().__init__()
        self.capacity_bytes = capacity_bytes
        self.hold_s = hold_s
        self.block_bytes = block_bytes
        self._lock = threading.Lock()
        self._ready: OrderedDict[bytes, tuple[bytes, float]] = OrderedDict()  # key -> (bytes, t)
        self._partial: dict[bytes, _Partial] = {}
        self._used = 0
        self._partial_bytes = 0
        self.bytes_received = 0
        self.blocks_received = 0
        self.blocks_dropped = 0  # expired, over capacity, or failed their checksum
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self._context.destroy(linger=0)
            raise ValueError(f"kv_transfer_config: cannot listen on {host}:{port} ({exc})") \
                from None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._receive_loop, name="kv-push-receiver",
                                        daemon=True)
        self._thread.start()

    # ---- receiving (its own thread) ------------------------------------------------------
    def _receive_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._closed.is_set():
            if not poller.poll(POLL_MS):
                continue
            try:
                header, body = self._socket.recv_multipart(flags=zmq.NOBLOCK)
                self._take_chunk(json.loads(header), body)
            except zmq.Again:
                continue
            except ValueError as exc:  # a header that cannot be true (another block layout)
                logger.warning("kv transfer: dropped a push message: %s", exc)
            except Exception:  # a malformed message costs its blocks, never the receiver
                logger.warning("kv transfer: dropped a malformed push message", exc_info=True)
        self._context.destroy(linger=0)

    def _read_header(self, header: Any, body: bytes
                     ) -> tuple[list[bytes], list[int], int, int, int]:
        """(keys, checksums, block_bytes, chunk, chunks) of a message; ValueError for a header
        that cannot be true (the message is dropped before anything is allocated)."""
        if not isinstance(header, dict):
            raise ValueError("a push header is not an object")
        if self.block_bytes is not None:
            block_bytes = _int(header, "block_bytes", self.block_bytes, self.block_bytes)
        else:
            block_bytes = _int(header, "block_bytes", 1, self.capacity_bytes)
        chunks = _int(header, "chunks", 1, min(MAX_CHUNKS, block_bytes))
        chunk = _int(header, "chunk", 0, chunks - 1)
        keys, checksums = header.get("keys"), header.get("checksums")
        if not isinstance(keys, list) or not isinstance(checksums, list) \
                or len(keys) != len(checksums) or not all(
                    isinstance(c, int) and not isinstance(c, bool) for c in checksums):
            raise ValueError("push header keys and checksums do not pair up")
        keys = [bytes.fromhex(k) for k in keys]
        lo, hi = chunk_bounds(block_bytes, chunks)[chunk]
        if len(body) != (hi - lo) * len(keys):
            raise ValueError(f"a chunk of {len(body)} bytes for {len(keys)} blocks")
        return keys, checksums, block_bytes, chunk, chunks

    def _take_chunk(self, header: Any, body: bytes) -> None:
        keys, checksums, block_bytes, chunk, chunks = self._read_header(header, body)
        lo, hi = chunk_bounds(block_bytes, chunks)[chunk]
        with self._lock:
            self.bytes_received += len(body)
            for i, (key, checksum) in enumerate(zip(keys, checksums, strict=True)):
                partial = self._partial_for(key, block_bytes, chunks, checksum)
                partial.data[lo:hi] = body[i * (hi - lo):(i + 1) * (hi - lo)]
                partial.missing.discard(chunk)
                if not partial.missing:
                    self._forget_partial(key)
                    self._complete(key, partial)
            self._expire()

    def _partial_for(self, key: bytes, block_bytes: int, chunks: int, checksum: int
                     ) -> _Partial:
        """The block `key` being assembled (a new one, room made for it within the capacity;
        one whose first slice disagrees with this header is dropped) (lock held)."""
        partial = self._partial.get(key)
        if partial is not None and partial.fits(block_bytes, chunks, checksum):
            return partial
        if partial is not None:
            self._forget_partial(key)
            self.blocks_dropped += 1
        self._partial_bytes += block_bytes
        self._make_room()
        partial = self._partial[key] = _Partial(block_bytes, chunks, checksum)
        return partial

    def _forget_partial(self, key: bytes) -> None:
        self._partial_bytes -= len(self._partial.pop(key).data)

    def _make_room(self) -> None:
        """Within the capacity again: the oldest incomplete blocks go first, then the oldest
        whole ones (lock held)."""
        while self.held_bytes > self.capacity_bytes and self._partial:
            self._forget_partial(next(iter(self._partial)))
            self.blocks_dropped += 1
        while self.held_bytes > self.capacity_bytes and self._ready:
            self._drop_oldest()

    def _complete(self, key: bytes, partial: _Partial) -> None:
        """Keep a block whose every slice arrived, if its checksum holds (lock held)."""
        data = bytes(partial.data)
        if block_checksum(key, data) != partial.checksum:
            self.blocks_dropped += 1
            logger.warning("kv transfer: a pushed block failed its checksum; dropped")
            return
        if key in self._ready:
            self._used -= len(self._ready.pop(key)[0])
        self._ready[key] = (data, time.monotonic())
        self._used += len(data)
        self.blocks_received += 1
        self._make_room()

    def _drop_oldest(self) -> None:
        key, (data, _) = self._ready.popitem(last=False)
        self._used -= len(data)
        self.blocks_dropped += 1
        self._note_removed([key])

    def _expire(self) -> None:
        """Drop blocks held past `hold_s`, and slices of blocks that never completed (lock
        held)."""
        cutoff = time.monotonic() - self.hold_s
        while self._ready and next(iter(self._ready.values()))[1] < cutoff:
            self._drop_oldest()
        for key in [k for k, p in self._partial.items() if p.since < cutoff]:
            self._forget_partial(key)
            self.blocks_dropped += 1

    # ---- the tier interface (engine and loader threads) ------------------------------------
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            self._expire()
            return [k in self._ready for k in keys]

    def get_many(self, keys: Sequence[bytes]) -> list[Payload | None]:
        """The held blocks of `keys` (taken out: a loaded block lives in the device cache)."""
        out: list[Payload | None] = []
        with self._lock:
            self._expire()
            for key in keys:
                entry = self._ready.pop(key, None)
                if entry is not None:
                    self._used -= len(entry[0])
                out.append(None if entry is None else entry[0])
        return out

    def put_many(self, items: Sequence[tuple[bytes, Payload]]) -> list[bytes]:
        return []  # blocks come from the wire only

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def held_bytes(self) -> int:
        """Bytes of whole blocks and of blocks still arriving (at most `capacity_bytes`)."""
        return self._used + self._partial_bytes

    @property
    def num_blocks(self) -> int:
        return len(self._ready)

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._thread.join(timeout=5)
