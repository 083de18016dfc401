"""The router in front of backends whose block hashes are not its own (vLLM's): their KV events,
in vLLM 0.32's exact wire shape with int block hashes from a foreign hash function, are indexed
by the hashes they carry and by their token ids, so a prompt goes to the backend holding its
tokens; a block matches only if its parent matched."""

from __future__ import annotations

import asyncio
import hashlib

import msgspec
import pytest

from pagedkv.events.publisher import to_wire_events
from pagedkv.events.wire import BlockRemoved, BlockStored, KVEventBatch, encode_batch, encode_seq
from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.hashing import get_hash_fn, hash_block_tokens, request_extra_keys
from pagedkv.router.backend import Backend
from pagedkv.router.kv_events import KVEventSubscriber
from pagedkv.router.policies import RouteRequest, make_policy
from pagedkv.router.prefix_index import PrefixMatch
from pagedkv.router.prompt import PromptHasher
from pagedkv.router.router import Router
from pagedkv.router.token_chains import TokenChains
from tests.vllm_kv_events import (
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmKVEventBatch,
)

BS = 4
XXHASH = get_hash_fn("xxhash")  # the backend's: not the router's sha256
A, B = "http://a.test", "http://b.test"


def foreign_hashes(tokens: list[int], seed: bytes, salt: str | None = None) -> list[int]:
    """A hash function that is not ours, shaped as vLLM's events publish it: each block a
    seeded sha256 of (parent, tokens, extras), chained, its low 64 bits as an int."""
    parent, out = hashlib.sha256(seed).digest(), []
    for i in range(len(tokens) // BS):
        extra = repr((salt,) if salt is not None and i == 0 else None).encode()
        parent = hashlib.sha256(parent + repr(tokens[i * BS:(i + 1) * BS]).encode()
                                + extra).digest()
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return out


def vllm_stored(hashes: list[int], parent: int | None, tokens: list[int], medium: str = "GPU",
                extra_keys: list | None = None) -> VllmBlockStored:
    return VllmBlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                           block_size=BS, lora_id=None, medium=medium, lora_name=None,
                           extra_keys=extra_keys, group_idx=0, kv_cache_spec_kind="full_attention")


class Fleet:
    """Two backends with no /kv_cache_info (as vLLM), each fed vLLM-encoded event frames."""

    def __init__(self, hash_settings: tuple[int, str] | None = None) -> None:
        self.backends = [Backend(A, events_endpoint="tcp://127.0.0.1:1"),
                         Backend(B, events_endpoint="tcp://127.0.0.1:2")]
        self.router = Router(self.backends, make_policy("kv-aware"), hash_settings=hash_settings)
        for backend in self.backends:
            self.router.mark_up(backend)
            self.router.set_kv_info(backend, None)
        self.subscribers = {b.name: KVEventSubscriber(self.router, b, context=None)
                            for b in self.backends}
        self.seq = 0

    def publish(self, backend: str, *events) -> None:
        payload = msgspec.msgpack.encode(VllmKVEventBatch(ts=1.0, events=list(events),
                                                          data_parallel_rank=0))
        asyncio.run(self.subscribers[backend].handle([b"kv@x", encode_seq(self.seq), payload]))
        self.seq += 1

    def hashes(self, tokens: list[int], salt: str | None = None) -> tuple[bytes, ...]:
        assert self.router.hasher is not None
        return tuple(self.router.hasher.block_hashes(tokens, salt))

    def match(self, backend: str, tokens: list[int], salt: str | None = None) -> PrefixMatch:
        return self.router.index.match(backend, self.hashes(tokens, salt))

    def route(self, tokens: list[int], salt: str | None = None) -> str:
        request = RouteRequest(prompt_tokens=len(tokens), block_hashes=self.hashes(tokens, salt))
        chosen, _ = self.router.route(request)
        return chosen.name


def test_prompts_go_to_the_vllm_backend_holding_their_tokens_block_size_learned_from_events():
    fleet = Fleet()  # no flags, no /kv_cache_info: the block size comes from the events
    p1, p2 = list(range(100, 124)), list(range(200, 224))  # 6 blocks each
    h1, h2 = foreign_hashes(p1, b"vllm-a"), foreign_hashes(p2, b"vllm-b")
    # vLLM stores a prompt's blocks in steps: the second event chains to the first's last hash.
    fleet.publish(A, vllm_stored(h1[:2], None, p1[:8]), vllm_stored(h1[2:], h1[1], p1[8:]))
    fleet.publish(B, vllm_stored(h2[:6], None, p2))
    assert fleet.router.hash_settings == (BS, "sha256")
    assert fleet.match(A, p1) == PrefixMatch(device_blocks=6)
    assert fleet.match(B, p1) == PrefixMatch(0, 0)
    assert fleet.match(B, p2 + [1, 2, 3, 4, 5]) == PrefixMatch(device_blocks=6)
    assert fleet.route(p1 + [7] * 9) == A
    assert fleet.route(p2) == B
    assert fleet.route(p1[:12]) == A  # a shorter prompt: its leading blocks are on A
    # Carried hashes are indexed too (they would match a router hashing as the backend does).
    assert fleet.router.index.match(A, h1).device_blocks == 6


def test_a_block_matches_only_if_its_parent_matched():
    fleet = Fleet(hash_settings=(BS, "sha256"))
    p = list(range(300, 316))
    h = foreign_hashes(p, b"vllm")
    # Blocks 2..3 arrive chained to a parent the router never saw: they get no key.
    fleet.publish(A, vllm_stored(h[2:], 999, p[8:]))
    assert fleet.match(A, p) == PrefixMatch(0, 0)
    assert fleet.router.token_chains.num_blocks(A) == 0
    # Other leading tokens, same later tokens: the later blocks do not match.
    fleet.publish(A, vllm_stored(h[:2], None, p[:8]))
    assert fleet.match(A, p) == PrefixMatch(device_blocks=2)
    other = list(range(900, 908)) + p[8:]
    assert fleet.match(A, other) == PrefixMatch(0, 0)
    # Now the parent is known: the same event places blocks 2..3.
    fleet.publish(A, vllm_stored(h[2:], h[1], p[8:]))
    assert fleet.match(A, p) == PrefixMatch(device_blocks=4)
    assert fleet.match(A, other) == PrefixMatch(0, 0)


def test_removal_by_int_hash_tiers_without_tokens_and_clear():
    fleet = Fleet(hash_settings=(BS, "sha256"))
    p = list(range(400, 420))  # 5 blocks
    h = foreign_hashes(p, b"vllm")
    fleet.publish(A, vllm_stored(h, None, p))
    # vLLM's offloading connector: CPU copies of blocks 0..4, hashes only, no tokens.
    fleet.publish(A, vllm_stored(h, None, [], medium="CPU"))
    fleet.publish(A, VllmBlockRemoved(block_hashes=[h[2]], medium="GPU", group_idx=0))
    assert fleet.match(A, p) == PrefixMatch(device_blocks=2, tier_blocks=3)
    fleet.publish(A, VllmBlockRemoved(block_hashes=[h[3]], medium="CPU"))
    assert fleet.match(A, p) == PrefixMatch(device_blocks=2, tier_blocks=1)
    fleet.publish(A, VllmBlockRemoved(block_hashes=[h[2]], medium="CPU"))
    assert fleet.router.token_chains.num_blocks(A) == 4  # h[2] gone from both media
    fleet.publish(A, VllmAllBlocksCleared())
    assert fleet.match(A, p) == PrefixMatch(0, 0)
    assert fleet.router.token_chains.num_blocks(A) == 0
    fleet.publish(A, vllm_stored(h, None, p))
    fleet.router.mark_down(fleet.backends[0], "restarted")
    assert fleet.router.token_chains.num_blocks(A) == 0


def test_cache_salt_in_vllms_untagged_extra_keys_and_blocks_we_cannot_rehash():
    fleet = Fleet(hash_settings=(BS, "sha256"))
    p = list(range(500, 516))
    salted = foreign_hashes(p, b"vllm", salt="tenant-1")
    fleet.publish(A, vllm_stored(salted, None, p, extra_keys=[("tenant-1",), None, None, None]))
    assert fleet.match(A, p, salt="tenant-1") == PrefixMatch(device_blocks=4)
    assert fleet.match(A, p) == PrefixMatch(0, 0)  # no salt: another prefix
    assert fleet.match(A, p, salt="tenant-2") == PrefixMatch(0, 0)
    # A multimodal block (an (identifier, offset) extra key) stops the chain there.
    q = list(range(600, 616))
    hq = foreign_hashes(q, b"vllm")
    fleet.publish(B, vllm_stored(hq, None, q, extra_keys=[None, (("img", 0),), None, None]))
    assert fleet.match(B, q) == PrefixMatch(device_blocks=1)
    # Another block size, a LoRA adapter, tokens that do not fill the blocks: no keys.
    for event in (VllmBlockStored(block_hashes=hq, parent_block_hash=None, token_ids=q * 2,
                                  block_size=2 * BS, lora_id=None, medium="GPU", lora_name=None),
                  VllmBlockStored(block_hashes=hq, parent_block_hash=None, token_ids=q,
                                  block_size=BS, lora_id=1, medium="GPU", lora_name="ad"),
                  vllm_stored(hq, None, q[:-1])):
        fleet.publish(A, VllmAllBlocksCleared(), event)
        assert fleet.match(A, q) == PrefixMatch(0, 0)


def test_a_pagedkv_backends_salted_blocks_stay_apart_when_its_hash_function_differs():
    """Our pool's events carry the salt in vLLM's extra_keys: a router hashing with sha256
    re-hashes an xxhash backend's blocks by tokens and salt."""
    fleet = Fleet(hash_settings=(BS, "sha256"))
    pool = BlockPool(8, enable_caching=True, enable_kv_cache_events=True)
    p = list(range(800, 812))  # 3 blocks
    tables = []
    for salt, n in (("tenant-1", 3), (None, 2)):  # the unsalted copy: its first 2 blocks
        hashes, parent = [], None
        for i in range(n):
            parent = hash_block_tokens(XXHASH, parent, p[i * BS:(i + 1) * BS],
                                       request_extra_keys(salt, None, i == 0))
            hashes.append(parent)
        tables.append(pool.get_new_blocks(n))
        pool.cache_full_blocks(tables[-1], hashes, 0, n, BS, p, cache_salt=salt)
        assert [b.block_hash for b in tables[-1]] == hashes  # our own hashes, unchanged
        pool.check_invariants(tables)
        backend = A if salt else B
        payload = encode_batch(KVEventBatch(ts=1.0, events=to_wire_events(pool.take_events()),
                                            data_parallel_rank=0))
        asyncio.run(fleet.subscribers[backend].handle([b"kv@x", encode_seq(fleet.seq),
                                                       payload]))
        fleet.seq += 1
    assert fleet.match(A, p, salt="tenant-1") == PrefixMatch(device_blocks=3)
    assert fleet.match(A, p) == PrefixMatch(0, 0)  # the unsalted prompt is not a hit
    assert fleet.match(A, p, salt="tenant-2") == PrefixMatch(0, 0)
    assert fleet.match(B, p) == PrefixMatch(device_blocks=2)
    assert fleet.match(B, p, salt="tenant-1") == PrefixMatch(0, 0)
    assert fleet.route(p, salt="tenant-1") == A and fleet.route(p) == B


def test_a_backend_with_the_routers_hashes_is_not_rehashed():
    router = Router([Backend(A), Backend(B)], make_policy("kv-aware"))
    info = {"block_size": BS, "prefix_caching_hash_algo": "sha256", "num_gpu_blocks": 64}
    router.set_kv_info(router.backends[0], info)
    router.set_kv_info(router.backends[1], {**info, "prefix_caching_hash_algo": "xxhash"})
    native, other = router.backends
    assert router.token_chains_for(native) is None and native.native_hashes
    # Another algorithm, same block size: prefixes still count, matched by token ids.
    assert other.hash_compatible and not other.native_hashes
    assert router.token_chains_for(other) is router.token_chains
    router.set_kv_info(other, {**info, "block_size": 2 * BS})
    assert not other.hash_compatible


def test_rehashed_keys_equal_the_prompt_hashers_and_the_map_is_bounded():
    chains = TokenChains(BS, "xxhash", max_blocks=3)
    tokens = list(range(700, 720))
    keys = chains.stored(A, BlockStored(block_hashes=[1, 2, 3, 4, 5], parent_block_hash=None,
                                        token_ids=tokens, block_size=BS))
    hasher = PromptHasher(None, block_size=BS, hash_algo="xxhash")
    assert keys == hasher.block_hashes(tokens, None)
    assert chains.num_blocks(A) == 3  # the oldest two dropped
    assert chains.removed(A, BlockRemoved(block_hashes=[1, 5])) == [keys[4]]
    with pytest.raises(ValueError, match="max_blocks"):
        TokenChains(BS, "sha256", max_blocks=0)
    with pytest.raises(ValueError, match="block_size"):
        TokenChains(0, "sha256")
