"""The engine core's composition root (pagedkv/engine/compose.py): every part built in one
place and handed over through constructors; a failed start leaves nothing running."""

from __future__ import annotations

import pickle
import threading
from dataclasses import FrozenInstanceError

import msgspec
import pytest

from pagedkv.engine import compose
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.core import EngineCore
from pagedkv.model.loader import weight_files
from pagedkv.store.config import StoreConfig


def store_args(model, tmp_path, **kw) -> EngineArgs:
    return EngineArgs(model=str(model), block_size=4, num_gpu_blocks_override=64,
                      enable_prefix_caching=True, kv_offloading_size=0.01,
                      kv_offloading_disk_path=str(tmp_path / "kv"), kv_offloading_disk_size=0.5,
                      **kw)


def store_savers() -> int:
    return sum(t.name == "kv-store-saver" for t in threading.enumerate())


def test_the_store_config_is_built_once_from_the_args_and_crosses_to_ranks(tiny_llama, tmp_path):
    config = compose.store_config(store_args(tiny_llama, tmp_path), enable_events=True)
    assert config.host_bytes == int(0.01 * (1 << 30)) and config.disk_bytes == 1 << 29
    assert config.disk_path == str(tmp_path / "kv") and config.remote_url is None
    assert config.enable_events
    assert config.weight_files == tuple(str(p) for p in weight_files(tiny_llama))
    assert config.weight_files  # the weights' digests are part of every key
    assert pickle.loads(pickle.dumps(config)) == config
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=StoreConfig) == config
    with pytest.raises(FrozenInstanceError):
        config.host_bytes = 0  # type: ignore[misc]
    assert compose.store_config(EngineArgs(model=str(tiny_llama)), enable_events=True) is None


def test_the_scheduler_gets_rank_zeros_store_through_its_constructor(tiny_llama, tmp_path):
    core = EngineCore.from_args(store_args(tiny_llama, tmp_path))
    try:
        connector = core.scheduler.kv_connector
        assert connector is not None and connector.kv is core.scheduler.kv_cache_manager
        assert connector.store is core.kv_store is core.runner.kv_connector.store
        assert connector.finished is core.runner.kv_connector.finished
        assert [type(t).__name__ for t in core.kv_store.tiers] == ["HostTier", "DiskTier"]
    finally:
        core.shutdown()


def test_a_store_over_an_all_sliding_model_is_refused_before_the_model_loads(
        tiny_mistral, tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(compose, "build_executor", lambda *a: built.append(a))
    with pytest.raises(ValueError, match="does not support sliding-window models"):
        compose.build_core(store_args(tiny_mistral, tmp_path))
    assert built == []


def test_a_failed_start_shuts_the_executor_and_its_store_down(tiny_llama, tmp_path,
                                                              monkeypatch):
    savers_before = store_savers()
    executors = []
    real_build = compose.build_executor

    def build(*args):
        executors.append(real_build(*args))
        return executors[-1]

    def fail(*args):
        raise RuntimeError("the scheduler could not be built")

    monkeypatch.setattr(compose, "build_executor", build)
    monkeypatch.setattr(compose, "build_scheduler", fail)
    with pytest.raises(RuntimeError, match="could not be built"):
        compose.build_core(store_args(tiny_llama, tmp_path))
    runner, = executors
    assert runner.kv_connector is None and runner.model is None and runner.kv_cache is None
    assert store_savers() == savers_before  # the store's saver thread stopped
