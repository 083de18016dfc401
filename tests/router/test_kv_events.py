"""The router's KV-event subscriber against a real ZMQ PUB socket sending wire-format batches."""

from __future__ import annotations

import asyncio
import time

import zmq
import zmq.asyncio

from pagedkv.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
    encode_seq,
)
from pagedkv.router.backend import Backend
from pagedkv.router.kv_events import KVEventSubscriber
from pagedkv.router.policies import make_policy
from pagedkv.router.prefix_index import PrefixMatch
from pagedkv.router.router import Router

H = [bytes([i]) * 32 for i in range(6)]
WAIT_S = 10.0  # how long a step of the scenario may wait for the subscriber


def stored(hashes: list[bytes], medium: str = "GPU") -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=None,
                       token_ids=list(range(4 * len(hashes))), block_size=4, medium=medium)


async def _scenario() -> None:
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    backend = Backend("http://127.0.0.1:1", events_endpoint=f"tcp://127.0.0.1:{port}")
    other = Backend("http://127.0.0.1:2")
    router = Router([backend, other], make_policy("kv-aware"), hash_settings=(4, "sha256"))
    sub = KVEventSubscriber(router, backend, ctx)
    task = asyncio.create_task(sub.run())
    seq = 0

    async def publish(*events) -> None:
        nonlocal seq
        batch = KVEventBatch(ts=0.0, events=list(events))
        await pub.send_multipart([b"kv", encode_seq(seq), encode_batch(batch)])
        seq += 1

    async def until(predicate) -> None:
        deadline = time.monotonic() + WAIT_S  # by the clock, not a count: a loaded CI is slow
        while time.monotonic() < deadline:
            if predicate():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the subscriber never applied the batch")

    try:
        # ZMQ's slow joiner: publish the first store until the subscriber has seen it.
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            await publish(stored(H[:1]))
            await asyncio.sleep(0.01)
            if router.index.match(backend.name, H).device_blocks:
                break
        await publish(stored(H[1:4]))
        await until(lambda: router.index.match(backend.name, H).device_blocks == 4)
        assert router.index.match(other.name, H) == PrefixMatch(0, 0)
        await publish(BlockRemoved(block_hashes=[H[2]]), stored(H[:6], medium="CPU"))
        await until(lambda: router.index.match(backend.name, H) == PrefixMatch(2, 4))
        # A shared Redis tier counts for the other backend too.
        await publish(stored(H[:3], medium="REDIS"))
        await until(lambda: router.index.match(other.name, H) == PrefixMatch(0, 3))
        gaps = router.metrics.kv_event_gaps.labels(backend.name)._value.get()
        seq += 5  # five batches lost on the way
        await publish(AllBlocksCleared())
        await until(lambda: router.index.match(backend.name, H).device_blocks == 0)
        assert router.metrics.kv_event_gaps.labels(backend.name)._value.get() == gaps + 1
        # A malformed message is skipped, and the stream goes on.
        await pub.send_multipart([b"kv", b"bad"])
        await publish(stored(H[:2]))
        await until(lambda: router.index.match(backend.name, H).device_blocks == 2)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.close(linger=0)
        ctx.term()


def test_subscriber_applies_wire_batches():
    asyncio.run(_scenario())
