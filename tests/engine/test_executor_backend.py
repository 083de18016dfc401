"""`distributed_executor_backend`: mp (worker processes) or ray (Ray actors; the ray extra).
The Ray executor's placement and its missing-extra error; its end-to-end tests run on a Ray
cluster in network-namespace hosts (tests/net/test_ray_executor.py, `make test-net`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedkv.engine.args import EngineArgs
from pagedkv.model.executor.ray_executor import import_ray, placement_strategy


@pytest.mark.parametrize("size, nnodes, strategy", [
    (2, 1, "PACK"), (4, 1, "PACK"), (2, 2, "STRICT_SPREAD"), (4, 4, "STRICT_SPREAD"),
    (4, 2, "SPREAD"),
])
def test_placement_is_one_node_per_rank_across_nodes(size, nnodes, strategy):
    assert placement_strategy(size, nnodes) == strategy


def test_the_backend_is_mp_unless_asked_and_checked():
    assert EngineArgs(model="m").distributed_executor_backend == "mp"
    with pytest.raises(ValueError, match="distributed_executor_backend.*'bogus'"):
        EngineArgs(model="m", distributed_executor_backend="bogus")
    with pytest.raises(ValueError, match="needs master_port"):
        EngineArgs(model="m", tensor_parallel_size=2, nnodes=2)
    # Ray places the ranks and picks the rendezvous port on rank 0's node itself.
    args = EngineArgs(model="m", tensor_parallel_size=2, nnodes=2,
                      distributed_executor_backend="ray")
    assert args.master_port is None


def test_without_ray_the_error_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ValueError, match=r"pip install 'pagedkv\[ray\]'"):
        import_ray()


def test_the_flag_rejects_an_unknown_backend_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "pagedkv.cli", "serve", "m",
                           "--distributed-executor-backend", "spark"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "spark" in proc.stderr
