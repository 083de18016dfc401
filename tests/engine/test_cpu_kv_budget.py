"""The CPU KV cache's default size follows memory (engine/kv_setup.py): the engine's memory
budget less the weights as loaded and the activation peak estimate, so the same GGUF model with
its weights kept packed gets more KV blocks than dequantized, by exactly the bytes packing
frees; an explicit KV size still wins; the start-up facts say which rule sized the cache."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType

from pagedkv import LLM
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.kv_setup import CPU_MEMORY_FRACTION, plan_kv_cache
from pagedkv.kv.plan import estimate_activation_peak_bytes
from pagedkv.model.config_files import load_hf_config
from tests.model.gguf_files import write_gguf

MEMORY = 4 << 20  # the engine's budget: weights (under 1 MiB here), activations, KV cache
BATCHED = 64  # tokens a step (a small activation peak)


@pytest.fixture(scope="module")
def q8_gguf(tiny_llama, tmp_path_factory):
    return write_gguf(tiny_llama, tmp_path_factory.mktemp("q8") / "model.gguf",
                      quant=GGMLQuantizationType.Q8_0)


def engine_facts(path, quantization: str, **kwargs):
    llm = LLM(str(path), dtype="bfloat16", block_size=4, max_model_len=64, max_num_seqs=512,
              device="cpu",
              max_num_batched_tokens=BATCHED, quantization=quantization, **kwargs)
    try:
        llm.llm_engine.check_invariants()
        return llm.llm_engine.client.ready
    finally:
        llm.shutdown()


def test_packed_weights_leave_their_freed_bytes_to_the_kv_cache(q8_gguf):
    packed = engine_facts(q8_gguf, "auto", cpu_memory_bytes=MEMORY)
    dense = engine_facts(q8_gguf, "none", cpu_memory_bytes=MEMORY)
    freed = dense.weights_bytes - packed.weights_bytes
    assert freed > 0
    peak = estimate_activation_peak_bytes(load_hf_config(str(q8_gguf)), BATCHED, "bfloat16",
                                          512)
    page = packed.block_bytes
    for facts in (packed, dense):
        assert facts.num_gpu_blocks == (MEMORY - facts.weights_bytes - peak) // page
        assert facts.kv_budget.startswith("--cpu-memory-bytes 0.00 GiB - weights")
        assert "capped" not in facts.kv_budget
    gained = packed.num_gpu_blocks - dense.num_gpu_blocks
    assert gained in (freed // page, freed // page + 1)  # the two floors may round apart
    assert gained > 0


def test_an_explicit_kv_size_wins_over_the_memory_budget(q8_gguf):
    facts = engine_facts(q8_gguf, "auto", cpu_memory_bytes=MEMORY,
                         kv_cache_memory_bytes=40 * 1024)
    assert facts.num_gpu_blocks == 40 * 1024 // facts.block_bytes
    assert facts.kv_budget == "--kv-cache-memory-bytes 0.00 GiB"


def test_the_default_takes_a_fraction_of_available_memory(tiny_llama, monkeypatch):
    """Without a budget: CPU_MEMORY_FRACTION of what is available (the loaded weights added
    back), less weights and activations; capped by what max_num_seqs sequences of
    max_model_len can use."""
    from pagedkv.engine import kv_setup

    available, weights = 48 << 20, 3 << 20
    monkeypatch.setattr(kv_setup, "host_memory_bytes", lambda: (1 << 40, available))
    args = EngineArgs(model=str(tiny_llama), block_size=4, max_model_len=64, device="cpu",
                      max_num_seqs=10 ** 4, max_num_batched_tokens=BATCHED)
    setup = plan_kv_cache(args, weights_bytes=weights)
    peak = estimate_activation_peak_bytes(load_hf_config(str(tiny_llama)), BATCHED, "auto",
                                          10 ** 4)
    memory = int(CPU_MEMORY_FRACTION * (available + weights))
    assert setup.num_blocks == (memory - weights - peak) // setup.spec.page_size_bytes
    assert setup.budget.startswith(f"{CPU_MEMORY_FRACTION} x 0.05 GiB available - weights")
    capped = plan_kv_cache(EngineArgs(model=str(tiny_llama), block_size=4, max_model_len=64,
                                      device="cpu", max_num_seqs=3,
                                      max_num_batched_tokens=BATCHED), weights_bytes=weights)
    assert capped.num_blocks == 3 * 16 + 1 and "capped at what 3 sequences" in capped.budget
