"""The commonest start-up mistakes end `pagedkv serve` with one line on stderr and exit code 2,
no traceback (issues 37 and 43), whether the error is found in the engine core process or in
this one: a max_model_len past the model's positions, a KV cache larger than the machine's
memory, a CUDA device on a machine without one, an unsupported architecture and a
tensor-parallel size that does not divide the attention heads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from pagedkv.engine.kv_setup import host_memory_bytes
from tests.server.helpers import REPO_ROOT, free_port

pytestmark = pytest.mark.timeout(400)

RUN_TIMEOUT_S = 300  # torch import and a tiny model's load, on a busy 2-core box


def _serve(model_dir, *flags: str, mode: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if mode is not None:
        env["PAGEDKV_ENGINE_CORE"] = mode
    cmd = [sys.executable, "-m", "pagedkv.cli", "serve", str(model_dir), "--port",
           str(free_port()), "--log-level", "warning", "--dtype", "float32", *flags]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)


def _one_line(result: subprocess.CompletedProcess) -> str:
    """The single line the failed command printed (asserting exit code 2 and nothing else)."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pagedkv serve: error: "), lines[0]
    return lines[0]


@pytest.mark.parametrize("mode", ["process", "inproc"])
def test_max_model_len_past_the_positions_is_one_line(tiny_llama, mode):
    line = _one_line(_serve(tiny_llama, "--max-model-len", "100000", mode=mode))
    assert "max_model_len=100000" in line and "max_position_embeddings (2048)" in line


def test_a_kv_cache_larger_than_the_machine_is_one_line_naming_the_flag(tiny_llama):
    total, _ = host_memory_bytes()
    asked = 2 * total
    line = _one_line(_serve(tiny_llama, "--device", "cpu", "--kv-cache-memory-bytes",
                            str(asked)))
    assert "--kv-cache-memory-bytes" in line
    assert f"{asked / (1 << 30):.1f} GiB" in line and f"{total / (1 << 30):.1f} GiB" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_one_line(tiny_llama):
    line = _one_line(_serve(tiny_llama, "--device", "cuda"))
    assert "--device" in line and "CUDA is not available" in line


def test_an_unsupported_architecture_is_one_line_naming_it(tiny_llama, tmp_path):
    """A GPT-2 directory: its architecture is named, not a layer count found missing."""
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(tiny_llama, gpt2)
    cfg = json.loads((gpt2 / "config.json").read_text())
    cfg.pop("num_hidden_layers")
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2", n_layer=2)
    (gpt2 / "config.json").write_text(json.dumps(cfg))
    line = _one_line(_serve(gpt2))
    assert "architecture 'GPT2LMHeadModel' is not supported; supported: Llama" in line


def test_tensor_parallel_size_not_dividing_the_heads_is_one_line(tiny_llama):
    line = _one_line(_serve(tiny_llama, "--tensor-parallel-size", "3"))
    assert "tensor_parallel_size=3 does not divide the model's 4 attention heads" in line
