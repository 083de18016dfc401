"""`pagedkv router --prefill URL... --decode URL...`: the prefill/decode fleet its flags build
(vllm-router's and sglang-router's spellings), and a ValueError naming each bad one."""

from __future__ import annotations

import pytest

from pagedkv.cli import build_parser
from pagedkv.commands.router import build_pd, build_router


def parse(*argv: str):
    return build_parser("router").parse_args(["router", *argv])


def test_prefill_and_decode_flags_build_a_split_fleet():
    args = parse("--pd-disaggregation", "--prefill", "http://p:1", "8998", "http://p:2",
                 "--decode", "http://d:1/", "--kv-events", "tcp://p:5557", "--kv-events", "-",
                 "--kv-events", "tcp://d:5557", "--pd-prefill-timeout", "2.5")
    router = build_router(args)
    assert [(b.url, b.role, b.events_endpoint) for b in router.backends] == [
        ("http://p:1", "prefill", "tcp://p:5557"), ("http://p:2", "prefill", None),
        ("http://d:1", "decode", "tcp://d:5557")]
    pd = build_pd(args, router)
    assert pd.prefill == {"http://p:1", "http://p:2"} and pd.decode == {"http://d:1"}
    assert pd.prefill_timeout_s == 2.5 and router.policy.name == "kv-aware"
    plain = parse("--backend", "http://h:1")
    assert build_pd(plain, build_router(plain)) is None


@pytest.mark.parametrize("argv, message", [
    (["--backend", "http://a", "--prefill", "http://p", "--decode", "http://d"], "not both"),
    (["--prefill", "http://p"], "--decode"),
    (["--pd-disaggregation", "--decode", "http://d"], "--prefill"),
    ([], "--backend"),
    (["--prefill", "http://p", "--decode", "http://p/"], "both --prefill and --decode"),
    (["--prefill", "p:8000", "--decode", "http://d"], "p:8000"),
    (["--prefill", "http://p", "--decode", "http://d", "--pd-prefill-timeout", "0"],
     "--pd-prefill-timeout"),
    (["--prefill", "http://p", "--decode", "http://d", "--kv-events", "tcp://x"],
     "--kv-events"),
])
def test_bad_split_flags_are_value_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        args = parse(*argv)
        build_pd(args, build_router(args))
