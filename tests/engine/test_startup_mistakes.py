"""The command line's common start-up mistakes made through the Python API instead: `LLM(...)`
refuses each with a ValueError naming the value (tests/server/test_startup_errors.py and
tests/server/test_cli_startup.py hold the command line's one-line answers)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagedkv import LLM
from pagedkv.engine.kv_setup import GiB, host_memory_bytes

pytestmark = pytest.mark.timeout(120)


def _refused(model, match: str, **kwargs) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(model=str(model), cpu_kernels="off", **kwargs)


def test_a_kv_cache_larger_than_the_machine_names_the_flag_and_both_sizes(tiny_llama):
    total, _ = host_memory_bytes()
    asked = 2 * total
    _refused(tiny_llama, rf"--kv-cache-memory-bytes asks for a {asked / GiB:.1f} GiB KV cache, "
             rf"more than this machine has \({total / GiB:.1f} GiB", device="cpu",
             kv_cache_memory_bytes=asked)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_cuda_device_without_cuda_names_the_device(tiny_llama):
    _refused(tiny_llama, r"device 'cuda' \(--device\): CUDA is not available", device="cuda",
             kv_cache_memory_bytes=1 << 20)


def test_max_model_len_past_the_positions_names_both(tiny_llama):
    _refused(tiny_llama, r"max_model_len=100000.*max_position_embeddings \(2048\)",
             max_model_len=100000, kv_cache_memory_bytes=1 << 20)


def test_an_unsupported_architecture_is_named_before_any_size_check(tiny_llama, tmp_path):
    """A GPT-2 config (no num_hidden_layers, other tensor names): the architecture is what is
    wrong, not the layer count the Llama reader would find missing."""
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(tiny_llama, gpt2)
    cfg = json.loads((gpt2 / "config.json").read_text())
    cfg.pop("num_hidden_layers")
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2", n_layer=2)
    (gpt2 / "config.json").write_text(json.dumps(cfg))
    _refused(gpt2, r"architecture 'GPT2LMHeadModel' is not supported; supported: "
             r"LlamaForCausalLM", kv_cache_memory_bytes=1 << 20)


def test_a_missing_model_path_names_it(tmp_path):
    _refused(tmp_path / "no-such-model", "no-such-model", kv_cache_memory_bytes=1 << 20)
