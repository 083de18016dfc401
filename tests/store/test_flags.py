"""Every new engine argument of the KV store and KV events is a command-line flag."""

from __future__ import annotations

import argparse

import pytest

from pagedkv.commands.engine_flags import add_engine_flags, engine_args_from_flags


def test_store_and_event_flags_reach_engine_args(tmp_path):
    parser = add_engine_flags(argparse.ArgumentParser())
    args = parser.parse_args([
        "--kv-offloading-size", "2.5", "--kv-offloading-disk-path", str(tmp_path),
        "--kv-offloading-disk-size", "20", "--kv-offloading-remote-url", "redis://127.0.0.1:1",
        "--kv-events-config", '{"enable_kv_cache_events": true, "topic": "kv"}'])
    engine_args = engine_args_from_flags(args, "model-dir")
    assert engine_args.kv_offloading_size == 2.5
    assert engine_args.kv_offloading_disk_path == str(tmp_path)
    assert engine_args.kv_offloading_disk_size == 20.0
    assert engine_args.kv_offloading_remote_url == "redis://127.0.0.1:1"
    assert engine_args.kv_events_config == '{"enable_kv_cache_events": true, "topic": "kv"}'
    assert engine_args.uses_kv_store


def test_bad_flag_values_are_value_errors():
    parser = add_engine_flags(argparse.ArgumentParser())
    args = parser.parse_args(["--kv-events-config", "{bad json"])
    with pytest.raises(ValueError, match="kv_events_config"):
        engine_args_from_flags(args, "model-dir")
    args = parser.parse_args(["--kv-offloading-disk-path", "/tmp/x",
                              "--kv-offloading-disk-size", "0"])
    with pytest.raises(ValueError, match="kv_offloading_disk_size"):
        engine_args_from_flags(args, "model-dir")
