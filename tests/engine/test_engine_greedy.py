"""Greedy generation through the whole engine equals transformers, whatever the memory settings."""

from __future__ import annotations

import pytest

from pagedkv import SamplingParams
from tests.engine.conftest import assert_pool_empty, hf_greedy, make_prompts

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

CONFIGS = {
    "default": dict(),
    "torch_reference_path": dict(cpu_kernels="off"),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "block_size_1": dict(block_size=1),
    "block_size_4": dict(block_size=4),
    "block_size_16": dict(block_size=16),
    "chunked_prefill": dict(max_num_batched_tokens=8, block_size=4),
    "preempt_recompute": dict(block_size=4, num_gpu_blocks_override=40, preemption_mode="recompute"),
    "preempt_swap": dict(block_size=4, num_gpu_blocks_override=40, preemption_mode="swap",
                         swap_space=0.01),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_greedy_matches_transformers(tiny_llama, make_llm, config):
    vocab = 400
    prompts = make_prompts(seed=1, vocab=vocab)
    llm = make_llm(tiny_llama, **CONFIGS[config])
    # The first prompt runs alone so that its prefix blocks are computed, hence cached, before
    # the others arrive (a block is cached only once computed).
    batches = [prompts[:1], prompts[1:]]
    outputs = [o for batch in batches
               for o in llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)]
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.finished
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == hf_greedy(tiny_llama, prompt, MAX_TOKENS), config
        assert output.outputs[0].finish_reason == "length"
    stats = llm.llm_engine.get_stats()
    if config.startswith("preempt"):
        assert stats.num_preemptions > 0
    if config == "no_prefix_caching":
        assert stats.prefix_cache_hits == 0
    elif not config.startswith("preempt"):
        # Prompts 0, 2, 4 share a 40-token prefix: later ones hit whole blocks of it.
        assert stats.prefix_cache_hits > 0
        assert sum(o.num_cached_tokens for o in outputs) == stats.prefix_cache_hits


@pytest.mark.parametrize("model", ["tiny_qwen2", "tiny_qwen3", "tiny_mistral", "tiny_llama_mqa",
                                   "tiny_qwen2_mixed"])
@pytest.mark.parametrize("cpu_kernels", ["auto", "off"])
def test_greedy_matches_transformers_other_architectures(request, make_llm, model, cpu_kernels):
    model_dir = request.getfixturevalue(model)
    # Mistral's (and qwen2_mixed's layers 1-2) window is 8 tokens: these prompts are far longer.
    prompts = make_prompts(seed=2, vocab=400, num=4, lengths=(10, 30))
    llm = make_llm(model_dir, block_size=4, max_num_batched_tokens=16, cpu_kernels=cpu_kernels)
    on_cpu = llm.llm_engine.runner.device.type == "cpu"  # a GPU runs its own kernels
    assert llm.llm_engine.runner.model.ops.cpu_fused is (cpu_kernels == "auto" and on_cpu)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS), model


def test_full_prompt_hit_recomputes_last_token(tiny_llama, make_llm):
    prompt = make_prompts(seed=3, vocab=400, num=1, shared_prefix=0, lengths=(32, 32))[0]
    llm = make_llm(tiny_llama, block_size=4)
    first = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    second = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    # 32 tokens = 8 full blocks, but the last token is recomputed, so 7 blocks are hits.
    assert second.num_cached_tokens == 28
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert_pool_empty(llm)


def test_switch_to_the_kernels_between_steps_repacks_the_linears(tiny_llama, make_llm,
                                                                 monkeypatch):
    """`cpu_kernels="auto"` whose background build lands mid-run: the runner switches between
    two steps, re-laying every linear for panel_linear (the instruction-set rule's choice);
    tokens still equal transformers'."""
    from pagedkv.model.layers import Linear

    monkeypatch.setenv("PAGEDKV_KERNEL_CHOICE", "isa")

    llm = make_llm(tiny_llama, block_size=4, device="cpu")
    runner = llm.llm_engine.runner
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m._panels is not None for m in linears)  # loaded at start: panels
    runner.model.ops.cpu_fused = False  # as before the build lands: the torch path, oneDNN
    runner.model.pack_linear_weights()
    assert all(m._panels is None for m in linears)
    prompts = make_prompts(seed=4, vocab=400, num=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert runner.model.ops.cpu_fused and all(m._panels is not None for m in linears)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(tiny_llama, prompt, MAX_TOKENS)
    assert_pool_empty(llm)
