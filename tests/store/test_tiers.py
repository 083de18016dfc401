"""Each tier on its own: bounded LRU with promotion, verified reads, restart, failures."""

from __future__ import annotations

import os

import pytest
import torch

from pagedkv.kv.eviction import LRUEvictionPolicy
from pagedkv.store.codec import CorruptBlockError, decode_block, encode_block
from pagedkv.store.disk import DiskTier
from pagedkv.store.host import HostTier
from pagedkv.store.payload import payload_buffer
from pagedkv.store.redis_tier import CircuitBreaker, RedisTier


def _key(i: int) -> bytes:
    return bytes([i]) * 48


def _payload(i: int, n: int = 100) -> bytes:
    return bytes([i % 251]) * n


def test_codec_round_trip_and_rejects_damage():
    value = encode_block(_key(1), _payload(1))
    assert decode_block(_key(1), value) == _payload(1)
    with pytest.raises(CorruptBlockError, match="another key"):
        decode_block(_key(2), value)
    with pytest.raises(CorruptBlockError):
        decode_block(_key(1), value[:-1])  # truncated
    flipped = bytearray(value)
    flipped[-10] ^= 0xFF
    with pytest.raises(CorruptBlockError, match="checksum"):
        decode_block(_key(1), bytes(flipped))
    with pytest.raises(CorruptBlockError):
        decode_block(_key(1), b"PKV")


def _as_bytes(payloads):
    return [None if p is None else payload_buffer(p).tobytes() if not isinstance(p, bytes) else p
            for p in payloads]


def test_host_tier_is_lru_bounded_and_promotes_on_read():
    tier = HostTier(capacity_bytes=300, block_bytes=100)
    tier.record_removals = True
    assert tier.slots.shape == (3, 100)  # preallocated once
    assert tier.put_many([(_key(i), _payload(i)) for i in range(3)]) == [_key(0), _key(1), _key(2)]
    assert _as_bytes(tier.get_many([_key(0)])) == [_payload(0)]  # 0 is now the most recently used
    assert tier.put_many([(_key(3), _payload(3))]) == [_key(3)]
    assert tier.contains_many([_key(i) for i in range(4)]) == [True, False, True, True]
    assert tier.take_removed() == [_key(1)]
    assert tier.used_bytes == 300 and tier.num_blocks == 3
    assert tier.put_many([(_key(3), _payload(3))]) == []  # already there: refreshed only
    assert tier.put_many([(_key(9), _payload(9, 99))]) == []  # not one block: refused
    assert tier.capacity_blocks(100) == 3
    # Key 1's slot was reused for key 3; the others still hold their own bytes.
    assert _as_bytes(tier.get_many([_key(i) for i in range(4)])) == [
        _payload(0), None, _payload(2), _payload(3)]
    tier.check_invariants()


def test_host_tier_copies_out_and_accepts_tensor_rows():
    tier = HostTier(capacity_bytes=200, block_bytes=100)
    row = torch.full((100,), 7, dtype=torch.uint8)
    tier.put_many([(_key(1), row)])
    row.fill_(8)  # the tier copied the row into its slot
    (got,) = tier.get_many([_key(1)])
    assert torch.equal(got, torch.full((100,), 7, dtype=torch.uint8))
    tier.put_many([(_key(2), _payload(2)), (_key(3), _payload(3))])  # evicts key 1's slot
    assert torch.equal(got, torch.full((100,), 7, dtype=torch.uint8))  # a reader's copy stays
    tier.check_invariants()


class _MostRecentFirst(LRUEvictionPolicy):
    """A real (if odd) policy: empty slots first, then the most recently used block."""

    def pop(self, num_blocks):
        free = self.free_blocks()
        empty = [b for b in free if b.block_hash is None]
        blocks = (empty + [b for b in reversed(free) if b.block_hash is not None])[:num_blocks]
        self.remove(blocks)
        return blocks


def test_host_tier_eviction_goes_through_the_policy():
    with pytest.raises(ValueError, match="'nope'"):
        HostTier(capacity_bytes=300, block_bytes=100, eviction_policy="nope")
    with pytest.raises(ValueError, match="holds no block"):
        HostTier(capacity_bytes=99, block_bytes=100)
    made = []

    def factory(blocks):
        made.append(len(blocks))
        return _MostRecentFirst(blocks)

    tier = HostTier(capacity_bytes=300, block_bytes=100, eviction_policy=factory)
    assert made == [3]
    tier.put_many([(_key(i), _payload(i)) for i in range(3)])
    tier.get_many([_key(0)])  # most recent: the policy evicts it first
    tier.put_many([(_key(3), _payload(3))])
    assert tier.contains_many([_key(i) for i in range(4)]) == [False, True, True, True]
    tier.check_invariants()
    lru = HostTier(capacity_bytes=300, block_bytes=100, eviction_policy="lru")
    lru.put_many([(_key(i), _payload(i)) for i in range(3)])
    lru.get_many([_key(0)])
    lru.put_many([(_key(3), _payload(3))])
    assert lru.contains_many([_key(i) for i in range(4)]) == [True, False, True, True]
    lru.check_invariants()


def test_disk_tier_survives_restart_in_lru_order(tmp_path):
    tier = DiskTier(tmp_path, capacity_bytes=10_000)
    tier.put_many([(_key(i), _payload(i, 1000)) for i in range(4)])
    os.utime(tier.path(_key(0)), (1, 1))  # oldest use
    os.utime(tier.path(_key(1)), (2, 2))
    assert tier.get_many([_key(0)]) == [_payload(0, 1000)]  # a read refreshes the file's time
    again = DiskTier(tmp_path, capacity_bytes=10_000)
    assert again.num_blocks == 4
    assert again.contains_many([_key(i) for i in range(4)]) == [True] * 4  # no promotion
    small = DiskTier(tmp_path, capacity_bytes=3 * again.used_bytes // 4)  # evicts one on scan
    assert small.contains_many([_key(1)]) == [False]
    assert not tier.path(_key(1)).exists()
    assert small.get_many([_key(0), _key(2), _key(3)]) == [_payload(i, 1000) for i in (0, 2, 3)]


def test_disk_tier_corrupt_and_truncated_files_are_misses(tmp_path):
    tier = DiskTier(tmp_path, capacity_bytes=10_000)
    tier.put_many([(_key(i), _payload(i, 500)) for i in range(3)])
    path = tier.path(_key(0))
    data = bytearray(path.read_bytes())
    data[200] ^= 0x01
    path.write_bytes(bytes(data))
    truncated = tier.path(_key(1))
    truncated.write_bytes(truncated.read_bytes()[:100])
    assert tier.get_many([_key(0), _key(1), _key(2)]) == [None, None, _payload(2, 500)]
    assert tier.num_corrupt == 2
    assert not path.exists() and not truncated.exists()
    assert tier.contains_many([_key(0), _key(1)]) == [False, False]


def test_disk_tier_leaves_no_partial_file_and_writes_atomically(tmp_path):
    tier = DiskTier(tmp_path, capacity_bytes=10_000)
    tier.put_many([(_key(5), _payload(5, 800))])
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files == [tier.path(_key(5))]  # no temp file left behind
    stale = tier.path(_key(5)).parent / ".tmpabandoned"
    stale.write_bytes(b"half a block")
    os.utime(stale, (1, 1))
    DiskTier(tmp_path, capacity_bytes=10_000)  # a restart sweeps old temp files
    assert not stale.exists()


def test_disk_tier_bad_directory_is_a_value_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="kv_offloading_disk_path"):
        DiskTier(blocker / "sub", capacity_bytes=100)


def test_redis_tier_round_trip_and_corrupt_value(redis_server):
    tier = RedisTier(redis_server.url)
    assert tier.put_many([(_key(i), _payload(i)) for i in range(3)]) == [_key(0), _key(1), _key(2)]
    assert tier.put_many([(_key(0), _payload(0))]) == []  # SET NX: already stored
    assert tier.contains_many([_key(0), _key(9)]) == [True, False]
    tier.client.set(b"pagedkv:kv:" + _key(1), b"garbage")
    assert tier.get_many([_key(0), _key(1), _key(2)]) == [_payload(0), None, _payload(2)]
    assert tier.num_corrupt == 1
    assert tier.contains_many([_key(1)]) == [False]  # the corrupt value was deleted
    tier.close()


def test_redis_tier_down_costs_hits_and_opens_the_breaker(redis_server):
    tier = RedisTier(redis_server.url, timeout_s=0.2, failure_threshold=2, cooldown_s=60)
    tier.put_many([(_key(0), _payload(0))])
    redis_server.stop()
    assert tier.get_many([_key(0)]) == [None]
    assert tier.contains_many([_key(0)]) == [False]
    assert tier.breaker.is_open
    assert tier.put_many([(_key(1), _payload(1))]) == []  # not even attempted
    assert tier.num_errors == 2


def test_circuit_breaker_half_opens_after_cooldown():
    now = [0.0]
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=5, clock=lambda: now[0])
    breaker.record_failure()
    assert breaker.allow()
    breaker.record_failure()
    assert not breaker.allow() and breaker.num_opened == 1
    now[0] = 5.0
    assert breaker.allow()  # one trial call
    breaker.record_success()
    assert breaker.allow() and not breaker.is_open


def test_host_tier_takes_the_pools_lfu_and_arc_by_name():
    """The pool's policy registry names work for the host tier: under LFU the block read least
    is the one a new block replaces."""
    lfu = HostTier(capacity_bytes=300, block_bytes=100, eviction_policy="lfu")
    lfu.put_many([(_key(i), _payload(i)) for i in range(3)])
    lfu.get_many([_key(0)])
    lfu.get_many([_key(0), _key(2)])
    lfu.put_many([(_key(3), _payload(3))])
    assert lfu.contains_many([_key(i) for i in range(4)]) == [True, False, True, True]
    lfu.check_invariants()
    arc = HostTier(capacity_bytes=300, block_bytes=100, eviction_policy="arc")
    arc.put_many([(_key(i), _payload(i)) for i in range(5)])
    assert sum(arc.contains_many([_key(i) for i in range(5)])) == 3
    assert bytes(arc.get_many([_key(4)])[0]) == _payload(4)
    arc.check_invariants()


def test_tiered_lookup_and_load_stop_at_the_first_miss(tmp_path):
    """Blocks present past a missing one are useless (a prefix is consecutive): neither lookup
    nor load counts them, whichever tier holds them."""
    from pagedkv.store.tiered import BlockMeta, TieredKVStore

    host = HostTier(capacity_bytes=10 * 100, block_bytes=100)
    disk = DiskTier(tmp_path, capacity_bytes=10_000)
    store = TieredKVStore([host, disk], identity=b"I" * 16, block_bytes=100, block_size=4)
    try:
        hashes = [bytes([i]) * 32 for i in range(6)]
        where = {0: host, 1: disk, 3: host, 4: disk, 5: host}  # block 2 is nowhere
        for i, tier in where.items():
            tier.put_many([(store.key(hashes[i]), _payload(i))])
        assert store.lookup(hashes) == 2
        assert store.lookup(hashes[3:]) == 3  # the blocks past the miss are really there
        assert store.lookup([hashes[2]] + hashes[3:]) == 0
        metas = [BlockMeta(h, None, (i,)) for i, h in enumerate(hashes)]
        loaded = store.load(metas)
        assert [payload_buffer(p) for p in loaded] == [_payload(0), _payload(1)]
    finally:
        store.close()


def test_disk_tier_full_disk_warns_once_per_interval(tmp_path, monkeypatch, caplog):
    """ENOSPC on every write: each failure is counted, but one warning per interval is logged
    (with the count since the last one); the blocks are simply not stored."""
    import errno
    import logging

    from pagedkv.store import disk as disk_module

    tier = DiskTier(tmp_path, capacity_bytes=100_000)
    now = [1000.0]
    tier._clock = lambda: now[0]

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_module.tempfile, "mkstemp", full)
    with caplog.at_level(logging.WARNING, logger="pagedkv.store.disk"):
        for i in range(50):
            assert tier.put_many([(_key(i), _payload(i))]) == []
        assert len(caplog.records) == 1 and "No space left" in caplog.records[0].getMessage()
        now[0] += disk_module.WRITE_WARNING_INTERVAL_S + 1
        for i in range(50, 60):
            tier.put_many([(_key(i), _payload(i))])
    assert tier.num_write_errors == 60 and tier.num_blocks == 0
    assert len(caplog.records) == 2
    # The second warning counts the 49 silent failures and its own.
    assert "50 block write(s) failed since the last warning (51 in all)" in \
        caplog.records[1].getMessage()


def test_tier_events_carry_the_blocks_extra_keys():
    """A tier's BlockStored carries its block's extra keys (vLLM's untagged form: the salt of a
    request's first block), so a router re-hashing tokens keeps salted prefixes apart."""
    from pagedkv.store.tiered import BlockMeta, TieredKVStore

    host = HostTier(capacity_bytes=10 * 100, block_bytes=100)
    store = TieredKVStore([host], identity=b"I" * 16, block_bytes=100, block_size=1,
                          enable_events=True)
    try:
        hashes = [bytes([i]) * 32 for i in range(2)]
        metas = [BlockMeta(hashes[0], None, (5,), extra_keys=("t1",)), BlockMeta(hashes[1], hashes[0], (6,))]
        store.save_async(metas, lambda: [_payload(0), _payload(1)])
        store.flush()
        stored = store.take_events()
        assert [(e.block_hashes, e.extra_keys, e.medium) for e in stored] == [
            ([hashes[0]], [("t1",)], host.medium), ([hashes[1]], [None], host.medium)]
    finally:
        store.close()


def test_disk_tier_corrupt_blocks_warn_once_per_interval(tmp_path, caplog):
    """A directory of damaged block files: every one is dropped and counted, one warning per
    interval is logged (with the count since the last one), never one line per block."""
    import logging

    from pagedkv.store import disk as disk_module

    tier = DiskTier(tmp_path, capacity_bytes=1_000_000)
    now = [1000.0]
    tier._clock = lambda: now[0]
    keys = [_key(i) for i in range(30)]
    assert len(tier.put_many([(k, _payload(i)) for i, k in enumerate(keys)])) == 30
    for key in keys:
        tier.path(key).write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING, logger="pagedkv.store.disk"):
        assert tier.get_many(keys[:20]) == [None] * 20
        assert len(caplog.records) == 1 and "unreadable" in caplog.records[0].getMessage()
        now[0] += disk_module.WRITE_WARNING_INTERVAL_S + 1
        assert tier.get_many(keys[20:]) == [None] * 10
    assert tier.num_corrupt == 30 and tier.num_blocks == 0
    assert len(caplog.records) == 2
    # The second warning counts the 19 silent drops and its own.
    assert "20 unreadable block file(s) dropped since the last warning (21 in all)" in \
        caplog.records[1].getMessage()
