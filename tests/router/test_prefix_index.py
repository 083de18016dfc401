"""PrefixIndex: leading-run matches per backend and medium, TTLs, caps, removal, shared tiers."""

from __future__ import annotations

from pagedkv.router.prefix_index import PrefixIndex, PrefixMatch

H = [bytes([i]) * 16 for i in range(8)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_match_counts_only_the_leading_run():
    index = PrefixIndex()
    index.store("a", [H[0], H[1], H[3]])
    assert index.match("a", H) == PrefixMatch(device_blocks=2, tier_blocks=0)
    assert index.match("b", H) == PrefixMatch(0, 0)
    index.remove("a", [H[0]])
    assert index.match("a", H) == PrefixMatch(0, 0)


def test_record_ttl_expires_and_events_do_not():
    clock = Clock()
    index = PrefixIndex(clock=clock)
    index.store("a", H[:3], ttl_s=10)
    index.store("b", H[:3], ttl_s=None)
    clock.now += 9.9
    assert index.match("a", H).device_blocks == 3
    clock.now += 0.2
    assert index.match("a", H).device_blocks == 0
    assert index.match("b", H).device_blocks == 3
    assert index.prune() == 3
    assert index.num_blocks("a") == 0 and index.num_blocks("b") == 3
    # An event-backed entry is not shortened by a later recorded one.
    index.store("b", H[:1], ttl_s=1)
    clock.now += 5
    assert index.match("b", H).device_blocks == 3


def test_capacity_drops_the_least_recently_stored():
    index = PrefixIndex()
    index.set_capacity("a", 4)
    index.store("a", H[:3])
    index.store("a", H[0:1])        # touched: now the most recent
    index.store("a", H[4:6])        # 5 entries > 4: H[1] goes
    assert index.num_blocks("a") == 4
    assert index.match("a", H).device_blocks == 1
    assert index.match("a", [H[0], H[2]]).device_blocks == 2


def test_tiers_extend_the_device_run_and_shared_tiers_count_everywhere():
    index = PrefixIndex(shared_media=("REDIS",))
    index.store("a", H[:2], medium="GPU")
    index.store("a", H[:5], medium="CPU")       # a's own host tier
    index.store("b", H[:6], medium="REDIS")     # shared: every backend can load it
    assert index.match("a", H) == PrefixMatch(device_blocks=2, tier_blocks=4)
    assert index.match("c", H) == PrefixMatch(device_blocks=0, tier_blocks=6)
    index.clear("b")                            # b's own entries; the shared tier stays
    assert index.match("c", H).tier_blocks == 6
    index.remove("c", H[:1], medium="REDIS")    # any backend's removal from the shared tier
    assert index.match("c", H).tier_blocks == 0
    index.clear("a")
    assert index.match("a", H) == PrefixMatch(0, 0)
