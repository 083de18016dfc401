"""Tensor parallelism on CPU (gloo, 2 ranks): the same tokens as one process and as
transformers for every registered architecture, with prefix caching, both preemption modes and
n > 1; the planner's per-rank bytes; a worker rank that dies or hangs ends the engine within
the timeout; two "machines" on loopback (pagedkv serve --node-rank 1)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from pagedkv import SamplingParams
from pagedkv.config.errors import EngineFatalError
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.kv_setup import plan_kv_cache
from pagedkv.kv.coordinator import HybridKVCacheManager
from tests.engine.conftest import assert_pool_empty, hf_greedy, make_prompts

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

# model fixture -> extra engine settings: every registered architecture (Llama's 2 KV heads
# split, Qwen3's 1 KV head replicated, Mistral's sliding window; Gemma 2 and 3 on KV cache
# groups, Gemma 3 with split and with replicated KV heads), both preemption modes.
CASES = {
    "tiny_llama": dict(),
    "tiny_qwen2": dict(num_gpu_blocks_override=40, preemption_mode="recompute"),
    "tiny_qwen3": dict(num_gpu_blocks_override=40, preemption_mode="swap", swap_space=0.01),
    "tiny_mistral": dict(max_num_batched_tokens=16),
    "tiny_gemma2": dict(),
    "tiny_gemma3": dict(num_gpu_blocks_override=64, max_num_batched_tokens=8,
                        preemption_mode="swap", swap_space=0.01),
    "tiny_gemma3_mqa": dict(max_num_batched_tokens=16),
}


def test_every_registered_architecture_has_a_case(request):
    """CASES covers the registry: a new architecture without a tensor-parallel case fails."""
    import json

    from pagedkv.model.registry import supported_architectures

    covered = {json.loads((request.getfixturevalue(m) / "config.json").read_text())
               ["architectures"][0] for m in CASES}
    assert covered == set(supported_architectures())


def _greedy_tokens(llm, prompts):
    outs = [o for batch in (prompts[:1], prompts[1:])  # the first alone: its blocks get cached
            for o in llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY,
                                  use_tqdm=False)]
    return outs, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("model", sorted(CASES))
def test_tp2_greedy_matches_tp1_and_transformers(request, make_llm, model):
    model_dir = request.getfixturevalue(model)
    prompts = make_prompts(seed=5, vocab=400, num=6, lengths=(10, 40))
    kwargs = dict(block_size=4, cpu_kernels="off", device="cpu", **CASES[model])
    tp1 = make_llm(model_dir, **kwargs)
    _, one = _greedy_tokens(tp1, prompts)
    tp2 = make_llm(model_dir, tensor_parallel_size=2, **kwargs)
    outs, two = _greedy_tokens(tp2, prompts)
    assert two == one
    assert two == [hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts]
    grouped = isinstance(tp2.llm_engine.scheduler.kv_cache_manager, HybridKVCacheManager)
    assert grouped == model.startswith("tiny_gemma")  # Gemma 2/3: KV cache groups
    stats = tp2.llm_engine.get_stats()
    if "preemption_mode" in CASES[model]:
        assert stats.num_preemptions > 0
    else:  # prompts 0, 2, 4 share a 40-token prefix
        assert stats.prefix_cache_hits > 0
        assert sum(o.num_cached_tokens for o in outs) == stats.prefix_cache_hits
    if model == "tiny_llama":  # n > 1 (forks, copy-on-write) sampled on rank 0: same draws
        params = SamplingParams(n=3, temperature=1.0, max_tokens=MAX_TOKENS, seed=7,
                                ignore_eos=True)
        a = tp1.generate({"prompt_token_ids": prompts[1]}, params, use_tqdm=False)[0]
        b = tp2.generate({"prompt_token_ids": prompts[1]}, params, use_tqdm=False)[0]
        assert [c.token_ids for c in b.outputs] == [c.token_ids for c in a.outputs]
        assert len({tuple(c.token_ids) for c in b.outputs}) > 1
    assert_pool_empty(tp2)


def test_tp2_int8_cache_matches_tp1_int8(make_llm, tiny_gemma2):
    """An int8 KV cache under tensor parallelism (Gemma 2: its soft-capped attention, KV cache
    groups): each rank quantizes its own KV heads with their per-token-head scales, so the two
    ranks hold what one process holds and give the same greedy tokens, prefix hits included."""
    model_dir = tiny_gemma2
    prompts = make_prompts(seed=6, vocab=400, num=4, lengths=(10, 30))
    kwargs = dict(block_size=4, cpu_kernels="off", kv_cache_dtype="int8", device="cpu")
    _, one = _greedy_tokens(make_llm(model_dir, **kwargs), prompts)
    tp2 = make_llm(model_dir, tensor_parallel_size=2, **kwargs)
    _, two = _greedy_tokens(tp2, prompts)
    assert two == one
    assert tp2.llm_engine.get_stats().prefix_cache_hits > 0


def test_kv_cache_is_sharded_by_head(tiny_llama, tiny_qwen3, tiny_gemma2):
    """The planner counts one rank's bytes: Llama's 2 KV heads split, so a rank's block is half
    the bytes and the same budget holds twice the blocks; Qwen3's one KV head is replicated;
    Gemma 2's KV cache groups split too, every group's spec with the pool's."""
    def blocks(model, tp):
        args = EngineArgs(model=str(model), block_size=4, kv_cache_memory_bytes=1 << 20,
                          tensor_parallel_size=tp)
        return plan_kv_cache(args)

    one, two = blocks(tiny_llama, 1), blocks(tiny_llama, 2)
    assert two.spec.page_size_bytes * 2 == one.spec.page_size_bytes
    assert two.num_blocks == (1 << 20) // two.spec.page_size_bytes == 2 * one.num_blocks
    assert blocks(tiny_qwen3, 2).num_blocks == blocks(tiny_qwen3, 1).num_blocks
    one, two = blocks(tiny_gemma2, 1), blocks(tiny_gemma2, 2)
    assert two.spec.page_size_bytes * 2 == one.spec.page_size_bytes
    assert two.num_blocks == 2 * one.num_blocks
    assert {g.spec.page_size_bytes for g in two.spec.groups} == {two.spec.page_size_bytes}


@pytest.mark.parametrize("kwargs, match", [
    (dict(tensor_parallel_size=3), "does not divide the model's 4 attention heads"),
    (dict(tensor_parallel_size=2, nnodes=3), "nnodes=3 must divide"),
    (dict(tensor_parallel_size=2, nnodes=2), "needs master_port"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
    (dict(distributed_timeout_s=0), "distributed_timeout_s"),
])
def test_bad_tensor_parallel_settings(tiny_llama, kwargs, match):
    from pagedkv import LLM

    with pytest.raises(ValueError, match=match):
        LLM(model=str(tiny_llama), cpu_kernels="off", kv_cache_memory_bytes=1 << 20, **kwargs)


def test_each_rank_of_a_machine_gets_its_own_cuda_device(monkeypatch):
    """NCCL needs one device per rank: an unindexed "cuda" becomes cuda:<local rank>; too few
    devices is a ValueError naming the count (checked before any process starts)."""
    from pagedkv.model.parallel.group import rank_device

    cpu = torch.device("cpu")
    assert rank_device(cpu, 1) == cpu
    assert rank_device(torch.device("cuda", 3), 1) == torch.device("cuda", 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert rank_device(torch.device("cuda"), 1) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="has 2 CUDA device"):
        rank_device(torch.device("cuda"), 2)


def _wait_fatal(llm, prompt, limit_s):
    start = time.monotonic()
    with pytest.raises(EngineFatalError, match="tensor-parallel group failed"):
        for _ in range(1000):  # an idle engine notices at its next step
            llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    assert time.monotonic() - start < limit_s


@pytest.mark.timeout(120)
def test_killed_worker_rank_fails_the_engine_fast(tiny_llama):
    from pagedkv import LLM

    llm = LLM(model=str(tiny_llama), tensor_parallel_size=2, distributed_timeout_s=5.0,
              block_size=4, cpu_kernels="off", kv_cache_memory_bytes=1 << 20, device="cpu")
    prompt = make_prompts(seed=6, vocab=400, num=1)[0]
    try:
        ok = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
        assert ok.outputs[0].token_ids == hf_greedy(tiny_llama, prompt, MAX_TOKENS)
        worker = llm.llm_engine.runner.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        _wait_fatal(llm, prompt, limit_s=5.0)
        assert "worker rank 1" in str(llm.llm_engine.runner._dead)
    finally:
        llm.shutdown()
    assert llm.llm_engine.runner is None


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_hung_worker_rank_fails_the_engine_within_the_timeout(tiny_llama):
    from pagedkv import LLM

    llm = LLM(model=str(tiny_llama), tensor_parallel_size=2, distributed_timeout_s=2.0,
              block_size=4, cpu_kernels="off", kv_cache_memory_bytes=1 << 20, device="cpu")
    worker = llm.llm_engine.runner.workers[0]
    try:
        os.kill(worker.pid, signal.SIGSTOP)  # alive, never answers
        _wait_fatal(llm, make_prompts(seed=6, vocab=400, num=1)[0], limit_s=15.0)
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        llm.shutdown()
    worker.join(10)
    assert worker.exitcode is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_machines_on_loopback(tiny_llama, make_llm):
    """Node 1 runs `pagedkv serve --node-rank 1` (rank 1 only, no server); node 0's engine
    joins it over tcp://127.0.0.1:PORT; the tokens are transformers'."""
    port = _free_port()
    flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(port), "--cpu-kernels", "off", "--block-size", "4",
             "--distributed-timeout-s", "60", "--device", "cpu"]
    node1 = subprocess.Popen([sys.executable, "-m", "pagedkv.cli", "serve", str(tiny_llama),
                              "--node-rank", "1", *flags])
    try:
        llm = make_llm(tiny_llama, tensor_parallel_size=2, nnodes=2, master_port=port,
                       block_size=4, cpu_kernels="off", distributed_timeout_s=60.0,
                       device="cpu")
        prompt = make_prompts(seed=8, vocab=400, num=1)[0]
        out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama, prompt, MAX_TOKENS)
        llm.shutdown()
        assert node1.wait(timeout=30) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tp2_nccl_greedy_matches_transformers(tiny_llama, make_llm):
    prompts = make_prompts(seed=5, vocab=400, num=4, lengths=(10, 40))
    llm = make_llm(tiny_llama, tensor_parallel_size=2, device="cuda", dtype="float32",
                   block_size=16)
    _, two = _greedy_tokens(llm, prompts)
    assert two == [hf_greedy(tiny_llama, p, MAX_TOKENS) for p in prompts]
