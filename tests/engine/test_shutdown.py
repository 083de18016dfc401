"""LLM.shutdown(): the KV cache and weights are released (references dropped, device memory
returned), and the LLM refuses further work."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from pagedkv import LLM, SamplingParams


def test_shutdown_drops_kv_cache_and_weights(tiny_llama):
    llm = LLM(model=str(tiny_llama), device="cpu", num_gpu_blocks_override=32)
    out = llm.generate([[1, 5, 9]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    runner = llm.llm_engine.runner
    kv = weakref.ref(runner.kv_cache.kv)
    weight = weakref.ref(runner.model.embed_tokens.weight)
    del runner
    llm.shutdown()
    llm.shutdown()  # idempotent
    gc.collect()
    assert kv() is None and weight() is None
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2]], use_tqdm=False)
    llm.llm_engine.check_invariants()


def test_shutdown_stops_the_kv_store_and_event_publisher_threads(tiny_llama):
    llm = LLM(model=str(tiny_llama), device="cpu", num_gpu_blocks_override=32,
              kv_offloading_size=0.01,
              kv_events_config={"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*"})
    llm.generate([list(range(1, 20))], SamplingParams(temperature=0, max_tokens=3),
                 use_tqdm=False)
    engine = llm.llm_engine
    threads = [engine.kv_store._saver, engine.event_publisher._thread]
    assert all(t.is_alive() for t in threads)
    llm.shutdown()
    assert not any(t.is_alive() for t in threads)
    llm.shutdown()  # idempotent: the closers ran once


@pytest.mark.cuda
def test_second_engine_sizes_from_freed_memory(tiny_llama):
    """On a GPU: the first engine takes half the memory; after its shutdown a second engine gets
    about as many KV blocks as the first (its memory is really free again)."""
    first = LLM(model=str(tiny_llama), device="cuda", gpu_memory_utilization=0.5,
                max_num_seqs=8)
    blocks = first.llm_engine.kv_setup.num_blocks
    first.shutdown()
    del first
    second = LLM(model=str(tiny_llama), device="cuda", gpu_memory_utilization=0.5,
                 max_num_seqs=8)
    # Were the first engine's GiBs still held, the second would get next to nothing (or fail);
    # other test processes on the same GPU may take a little of it meanwhile.
    assert second.llm_engine.kv_setup.num_blocks >= 0.8 * blocks
    out = second.generate([[1, 5, 9]], SamplingParams(temperature=0, max_tokens=3),
                          use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    second.shutdown()
    # What stays is torch's cuBLAS workspaces (tens of MiB), not the GiBs of the KV cache.
    assert torch.cuda.memory_allocated() < 256 << 20
