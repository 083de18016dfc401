"""Chained block hashes: determinism across processes, extra keys, incremental hashing."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.kv.hashing import (
    NONE_HASH,
    RequestBlockHasher,
    encode_extra_keys,
    get_hash_fn,
    hash_block_tokens,
    request_extra_keys,
)
from tests.kv.conftest import make_request

SHA = get_hash_fn("sha256")
ROOT = Path(__file__).resolve().parents[2]


def reference_hashes(hash_fn, block_size, tokens, salt=None, lora=None):
    out, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = hash_block_tokens(hash_fn, parent, tokens[i * block_size:(i + 1) * block_size],
                                   request_extra_keys(salt, lora, i == 0))
        out.append(parent)
    return out


def test_hash_fns_and_unknown_name():
    assert len(get_hash_fn("sha256")(b"x")) == 32
    assert len(get_hash_fn("xxhash")(b"x")) == 16
    with pytest.raises(ValueError, match="md5"):
        get_hash_fn("md5")


def test_none_hash_and_serialization_are_fixed_golden_values():
    # Golden values: a change here breaks hash sharing with other instances and stored caches.
    assert NONE_HASH.hex() == (
        "cd6eeedd434b90afc368b46d71261e381e175acf7cdc564bb57ba04affefb8a7")
    assert hash_block_tokens(SHA, None, [1, 2, 3, 4], (("salt", "s"), ("lora", "l"))).hex() == (
        "e615550d8ded132abde9aabfdb50a916a9814a93f81505b28a24b322489e111b")
    assert hash_block_tokens(get_hash_fn("xxhash"), None, [1, 2, 3, 4]).hex() == (
        "588ecce12fb4ab16a168b024c4ae4383")
    assert hash_block_tokens(SHA, None, [1, 2]) == hash_block_tokens(SHA, NONE_HASH, [1, 2])


def test_hash_depends_on_parent_tokens_order_and_keys():
    base = hash_block_tokens(SHA, None, [1, 2, 3, 4])
    assert base == hash_block_tokens(SHA, None, (1, 2, 3, 4))
    assert base != hash_block_tokens(SHA, None, [2, 1, 3, 4])
    assert base != hash_block_tokens(SHA, base, [1, 2, 3, 4])
    assert base != hash_block_tokens(SHA, None, [1, 2, 3, 4], (("lora", "a"),))
    # Length prefix: [1] + parent-ish bytes cannot masquerade as a different split.
    assert hash_block_tokens(SHA, None, [1]) != hash_block_tokens(SHA, None, [1, 0])


def test_salt_and_lora_keys_never_collide():
    salt = hash_block_tokens(SHA, None, [5] * 4, (("salt", "x"),))
    lora = hash_block_tokens(SHA, None, [5] * 4, (("lora", "x"),))
    assert salt != lora
    assert encode_extra_keys(None) == encode_extra_keys(())
    assert encode_extra_keys((("k", 1),)) != encode_extra_keys((("k", "1"),))
    with pytest.raises(ValueError):
        encode_extra_keys(("salt",))
    with pytest.raises(ValueError):
        encode_extra_keys((("k", 1.5),))
    with pytest.raises(ValueError, match="int64"):
        hash_block_tokens(SHA, None, [2**70])


def test_request_extra_keys_salt_first_block_only():
    assert request_extra_keys("s", "l", True) == (("salt", "s"), ("lora", "l"))
    assert request_extra_keys("s", "l", False) == (("lora", "l"),)
    assert request_extra_keys(None, None, True) is None


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_incremental_hasher_matches_reference_and_hashes_each_block_once(algo):
    calls = []
    fn = get_hash_fn(algo)

    def counting(data: bytes) -> bytes:
        calls.append(data)
        return fn(data)

    hasher = RequestBlockHasher(counting, 4)
    req = make_request("r", range(10), cache_salt="s", lora_name="l")
    hashes = []
    hasher(req, hashes)
    assert len(hashes) == 2 and len(calls) == 2
    req.append(10)
    hasher(req, hashes)
    assert len(hashes) == 2 and len(calls) == 2  # block 2 not full yet
    req.append(11, 12, 13, 14, 15, 16)
    hasher(req, hashes)
    assert len(hashes) == 4 and len(calls) == 4
    assert hashes == reference_hashes(fn, 4, req.all_token_ids, "s", "l")


def test_salt_changes_every_chained_hash():
    a = reference_hashes(SHA, 4, list(range(12)))
    b = reference_hashes(SHA, 4, list(range(12)), salt="tenant")
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_hash_deterministic_across_processes():
    code = ("from pagedkv.kv.hashing import *\n"
            "from pagedkv.kv.hashing import request_extra_keys as k\n"
            "fn = get_hash_fn('{algo}'); p = None\n"
            "for i in range(3):\n"
            "    p = hash_block_tokens(fn, p, list(range(i*4, i*4+4)), k('s', 'l', i == 0))\n"
            "print(p.hex())\n")
    for algo in ("sha256", "xxhash"):
        expected = reference_hashes(get_hash_fn(algo), 4, list(range(12)), "s", "l")[-1].hex()
        for seed in ("0", "12345"):
            env = dict(os.environ, PYTHONHASHSEED=seed)
            out = subprocess.run([sys.executable, "-c", code.format(algo=algo)], env=env, cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout.strip()
            assert out == expected
