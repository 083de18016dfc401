"""`pagedkv router` flags: a Router built from them, and a ValueError naming each bad one."""

from __future__ import annotations

import pytest

from pagedkv.cli import build_parser
from pagedkv.commands.router import build_router
from pagedkv.testing import build_tokenizer_files


def parse(*argv: str):
    return build_parser("router").parse_args(["router", *argv])


def test_flags_build_the_router(tmp_path):
    model = build_tokenizer_files(tmp_path / "m")
    router = build_router(parse(
        "--backend", "http://127.0.0.1:1/", "--backend", "http://127.0.0.1:2",
        "--kv-events", "tcp://127.0.0.1:5557", "--kv-events", "-", "--model", str(model),
        "--block-size", "8", "--prefix-caching-hash-algo", "xxhash", "--tier-weight", "0.25",
        "--imbalance-factor", "2"))
    assert [b.url for b in router.backends] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert [b.events_endpoint for b in router.backends] == ["tcp://127.0.0.1:5557", None]
    assert router.policy.name == "kv-aware" and router.hash_settings == (8, "xxhash")
    assert router.hasher is not None and router.hasher.block_size == 8
    assert router.weights.tier_weight == 0.25 and router.weights.imbalance_factor == 2
    assert build_router(parse("--backend", "http://h:1", "--policy", "session")).hasher is None
    assert not parse("--backend", "http://h:1").access_log  # no line per request by default
    assert parse("--backend", "http://h:1", "--access-log").access_log


def test_kv_aware_starts_without_model_and_hashes_ids_from_the_backends():
    """No --model: no local tokenizer; once the hash settings are known the hasher hashes the
    ids a backend's /tokenize gives (remote_tokens.py; tested in test_remote_tokens.py)."""
    router = build_router(parse("--backend", "http://h:1", "--block-size", "4",
                                "--prefix-caching-hash-algo", "sha256"))
    assert router.policy.name == "kv-aware" and router.tokenizer is None
    assert router.needs_prompt_hashes and router.hasher.tokenizer is None
    assert router.hasher.route_request_from_ids(list(range(9)), None).prompt_blocks == 2


@pytest.mark.parametrize("argv, message", [
    (["--policy", "round-robin", "--backend", "ftp://x"], "ftp://x"),
    (["--policy", "least-load", "--backend", "http://a", "--backend", "http://a/"], "duplicate"),
    (["--policy", "session", "--backend", "http://a", "--block-size", "4"],
     "--prefix-caching-hash-algo"),
    (["--policy", "session", "--backend", "http://a", "--kv-events", "tcp://x", "--kv-events",
      "tcp://y"], "--kv-events"),
    (["--policy", "session", "--backend", "http://a", "--usage-weight", "-1"], "usage_weight"),
    (["--policy", "session", "--backend", "http://a", "--record-ttl", "0"], "record_ttl"),
])
def test_bad_flags_are_value_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        build_router(parse(*argv))


def test_the_router_imports_no_torch(tmp_path):
    """`pagedkv router` never runs a model: building it (a tokenizer included) and its app stays
    torch-free (torch alone costs a second of CPU at every start)."""
    import subprocess
    import sys

    model = build_tokenizer_files(tmp_path / "m")
    code = ("import sys\n"
            "from pagedkv.cli import build_parser\n"
            "from pagedkv.commands.router import build_router\n"
            "import pagedkv.server.graceful, pagedkv.utils\n"
            "from pagedkv.router.app import create_router_app\n"
            "args = build_parser('router').parse_args(['router', '--backend', 'http://h:1', "
            f"'--block-size', '4', '--prefix-caching-hash-algo', 'sha256', '--model', "
            f"{str(model)!r}])\n"
            "router = build_router(args)\n"
            "assert router.hasher is not None and router.hasher.tokenizer is not None\n"
            "create_router_app(router)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout
