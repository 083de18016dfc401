"""The engine with an fp8 or int8 KV cache (kv_cache_dtype): more blocks from the same memory,
greedy tokens the model dtype's cache rates as best (within the measured logit error), and the
same tokens through prefix caching, copy-on-write forks, chunked prefill and both preemption
modes (decodes read the cache in place with the fused CPU kernels, the tests' default), for
each format: fp8 e4m3 and e5m2 with calibrated per-head scales, fp8 with a checkpoint's own
k_scale / v_scale tensors, int8 with per-token-head scales."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedkv import SamplingParams
from pagedkv.model.runner import ModelRunner
from pagedkv.testing.kv_quant_accuracy import teacher_forced_logits
from tests.engine.conftest import make_prompts
from tests.model.test_kv_int8 import INT8_LOGIT_BOUND
from tests.model.test_kv_quant import LOGIT_BOUND

BOUNDS = {**LOGIT_BOUND, "int8": INT8_LOGIT_BOUND}
# Each format the engine offers: (kv_cache_dtype, whether the checkpoint carries fp8 scales).
FORMATS = {"fp8": ("fp8", False), "fp8_e5m2": ("fp8_e5m2", False), "int8": ("int8", False),
           "fp8_checkpoint_scales": ("fp8", True)}
HOST_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}


@pytest.fixture(scope="session")
def llama_with_kv_scales(tiny_llama, tmp_path_factory):
    """tiny_llama whose checkpoint also holds per-head fp8 `k_scale` / `v_scale` tensors: twice
    the calibrated ones (powers of two, so the engine's own scales could never equal them).
    Returns (model_dir, [(k_scales, v_scales) per layer])."""
    calibrated = ModelRunner(tiny_llama, block_size=4, num_blocks=8, device="cpu",
                             kv_cache_dtype="fp8", cpu_kernels="off").kv_scales
    scales = [(tuple(2 * k for k in s.k_scale), tuple(2 * v for v in s.v_scale))
              for s in calibrated]
    model_dir = tmp_path_factory.mktemp("llama_kv_scales") / "model"
    shutil.copytree(tiny_llama, model_dir)
    path = model_dir / "model.safetensors"
    state = load_file(str(path))
    for i, (k, v) in enumerate(scales):
        state[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)
        state[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v)
    save_file(state, str(path), metadata={"format": "pt"})
    return model_dir, scales


@pytest.fixture(params=sorted(FORMATS))
def cache_format(request, tiny_llama):
    """(format name, model_dir, kv_cache_dtype, the checkpoint's scales or None)."""
    cache_dtype, from_checkpoint = FORMATS[request.param]
    if not from_checkpoint:
        return request.param, tiny_llama, cache_dtype, None
    model_dir, scales = request.getfixturevalue("llama_with_kv_scales")
    return request.param, model_dir, cache_dtype, scales


def _assert_scales_are_the_checkpoints(llm, scales) -> None:
    if scales is not None:
        got = [(s.k_scale, s.v_scale) for s in llm.llm_engine.runner.kv_scales]
        assert got == scales

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _generate(llm, prompts, params=GREEDY):
    """`params`: one for all prompts or one per prompt."""
    per_prompt = list(params) if isinstance(params, list) else [params] * len(prompts)
    # The first prompt alone, so its prefix blocks are cached before the others arrive.
    batches = [(prompts[:1], per_prompt[:1]), (prompts[1:], per_prompt[1:])]
    return [o for batch, batch_params in batches
            for o in llm.generate([{"prompt_token_ids": p} for p in batch], batch_params,
                                  use_tqdm=False)]


# int8 blocks: 16 one-byte values plus a 4-byte scale per head vector: 20 / 64 of float32's.
@pytest.mark.parametrize("cache_dtype, ratio", [("fp8", 4), ("fp8_e5m2", 4), ("int8", 64 / 20)])
def test_the_same_memory_holds_more_blocks(tiny_llama, make_llm, cache_dtype, ratio):
    """float32 model: an fp8 block is a quarter of the bytes, so 4x the blocks in 2 MiB; an
    int8 block with its scales 20/64 (head size 16 here: the scales are a fifth of it)."""
    plain = make_llm(tiny_llama, kv_cache_memory_bytes=2 << 20, block_size=4)
    fp8 = make_llm(tiny_llama, kv_cache_memory_bytes=2 << 20, block_size=4,
                   kv_cache_dtype=cache_dtype)
    page = plain.llm_engine.kv_setup.spec.page_size_bytes
    assert page == 4 * 2 * 2 * 2 * 16 * 4  # block 4 x 2 layers x K,V x 2 heads x 16 x 4 bytes
    assert fp8.llm_engine.kv_setup.spec.page_size_bytes * ratio == page
    assert plain.llm_engine.kv_setup.num_blocks == (2 << 20) // page
    assert fp8.llm_engine.kv_setup.num_blocks == (2 << 20) // (page / ratio)
    for llm in (plain, fp8):
        cache = llm.llm_engine.runner.kv_cache
        assert cache.nbytes == llm.llm_engine.kv_setup.num_blocks * llm.llm_engine.kv_setup.spec.page_size_bytes
        assert llm.llm_engine.scheduler.kv_cache_manager.num_usable_blocks == \
            llm.llm_engine.kv_setup.num_blocks - 1


def _assert_near_best(model_dir, prompt, tokens, bound):
    """Each token is within 2 x bound of the model dtype cache's best logit at its position
    (if every logit is off by at most `bound`, the fp8 argmax is at most 2 x bound below)."""
    runner = ModelRunner(model_dir, block_size=4, num_blocks=128, device="cpu")
    ref = teacher_forced_logits(runner, prompt, tokens[:-1])
    chosen = ref[torch.arange(len(tokens)), torch.tensor(tokens)]
    gap = ref.max(-1).values - chosen
    assert float(gap.max()) <= 2 * bound, gap
    return int((gap == 0).sum())


CONFIGS = {
    "default": dict(),
    "cold": dict(enable_prefix_caching=False),  # every prompt computes its own blocks
    "chunked_prefill": dict(max_num_batched_tokens=8),
    "preempt_recompute": dict(num_gpu_blocks_override=40, preemption_mode="recompute"),
    "preempt_swap": dict(num_gpu_blocks_override=40, preemption_mode="swap", swap_space=0.01),
}


def test_greedy_tokens_through_every_memory_path(cache_format, make_llm):
    _, model_dir, cache_dtype, scales = cache_format
    prompts = make_prompts(seed=1, vocab=400)
    runs = {}
    for name, config in CONFIGS.items():
        llm = make_llm(model_dir, block_size=4, kv_cache_dtype=cache_dtype, **config)
        _assert_scales_are_the_checkpoints(llm, scales)
        outputs = _generate(llm, prompts)
        runs[name] = [list(o.outputs[0].token_ids) for o in outputs]
        stats = llm.llm_engine.get_stats()
        if name.startswith("preempt"):
            assert stats.num_preemptions > 0, name
        elif name == "cold":
            assert stats.prefix_cache_hits == 0
        else:
            assert stats.prefix_cache_hits > 0, name  # prompts 0, 2, 4 share 40 tokens
        if name == "preempt_swap":
            assert stats.num_swaps > 0
            cache = llm.llm_engine.runner.kv_cache
            assert cache.host_kv.dtype == HOST_DTYPES[cache_dtype]
            assert (cache.host_scales_kv is None) == (cache_dtype != "int8")
    # Swapped blocks come back byte for byte (int8: with their scales), cached blocks are read
    # as they were written, and fp8's scales never change: every path yields the same tokens.
    for name, tokens in runs.items():
        assert tokens == runs["default"], name
    exact = sum(_assert_near_best(model_dir, p, t, BOUNDS[cache_dtype])
                for p, t in zip(prompts, runs["default"], strict=True))
    # The same argmax as the model dtype's cache (e5m2, two mantissa bits: measured 52 of 60).
    floor = 0.85 if cache_dtype == "fp8_e5m2" else 0.9
    assert exact >= floor * len(prompts) * MAX_TOKENS


def test_parallel_sampling_forks_copy_on_write(cache_format, make_llm):
    """n=3 greedy samples share the prompt's blocks (the last one copied on write, int8 with
    its scales): with a greedy sampler all three equal the single-sample output."""
    _, model_dir, cache_dtype, scales = cache_format
    prompts = make_prompts(seed=3, vocab=400, num=2, shared_prefix=0, lengths=(9, 9))
    llm = make_llm(model_dir, block_size=4, kv_cache_dtype=cache_dtype)
    _assert_scales_are_the_checkpoints(llm, scales)
    cache = llm.llm_engine.runner.kv_cache
    copies, copy = [], cache.copy
    cache.copy = lambda mapping: (copies.extend(mapping), copy(mapping))
    single = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    forked = llm.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS,
                                         ignore_eos=True), use_tqdm=False)
    for one, three in zip(single, forked, strict=True):
        assert [list(c.token_ids) for c in three.outputs] == [list(one.outputs[0].token_ids)] * 3
    assert copies, "no block was copied on write"


def test_kv_cache_dtype_flag_reaches_the_engine_args(capsys):
    from pagedkv.cli import build_parser
    from pagedkv.commands.engine_flags import engine_args_from_flags

    for command in (("serve", "m"), ("generate", "m", "--prompt", "x")):
        for fmt in ("fp8_e5m2", "int8"):
            args = build_parser(command[0]).parse_args([*command, "--kv-cache-dtype", fmt])
            assert engine_args_from_flags(args, "m").kv_cache_dtype == fmt
        with pytest.raises(SystemExit) as exited:
            build_parser(command[0]).parse_args([*command, "--kv-cache-dtype", "int4"])
        assert exited.value.code == 2 and "'int4'" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["int4", "INT8", "fp8_e4m3fn", "", None, 8])
def test_bad_kv_cache_dtypes_are_value_errors_naming_them(tiny_llama, bad):
    """EngineArgs and LLM refuse a format they do not know before loading anything."""
    from pagedkv import LLM
    from pagedkv.engine.args import EngineArgs

    with pytest.raises(ValueError, match=f"kv_cache_dtype must be one of .*got {bad!r}"):
        EngineArgs(model=str(tiny_llama), kv_cache_dtype=bad).validate()
    with pytest.raises(ValueError, match=f"got {bad!r}"):
        LLM(str(tiny_llama), kv_cache_dtype=bad)


@pytest.mark.parametrize("cache_dtype", ["fp8", "int8"])
def test_cascade_attention_over_shared_prefix_blocks(tiny_llama, make_llm, monkeypatch,
                                                     cache_dtype):
    """Requests sharing an 80-token prefix decode together: with prefix caching (and the
    pure-torch path: the fused kernel reads each decode's blocks in place instead) their
    quantized prefix blocks are attended once per group (cascade attention over the
    dequantized copy); the tokens equal those of the same engine without prefix caching (no
    shared blocks) and those of the fused kernels reading in place."""
    import pagedkv.model.attention as attention

    calls = []
    shared = attention.shared_prefix_attention
    monkeypatch.setattr(attention, "shared_prefix_attention",
                        lambda *a, **k: (calls.append(1), shared(*a, **k))[1])
    prompts = make_prompts(seed=4, vocab=400, num=6, shared_prefix=80, lengths=(3, 9))
    prompts = [p for i, p in enumerate(prompts) if i % 2 == 0]  # the three sharing the prefix
    runs = []
    for caching, kernels in ((True, "off"), (False, "off"), (True, "auto")):
        llm = make_llm(tiny_llama, block_size=4, kv_cache_dtype=cache_dtype,
                       enable_prefix_caching=caching, cpu_kernels=kernels, device="cpu")
        runs.append([list(o.outputs[0].token_ids) for o in _generate(llm, prompts)])
        if caching and kernels == "off":
            assert calls, "no cascade attention over the shared prefix"
    assert runs[0] == runs[1] == runs[2]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_int8_core_process_preempts_under_a_tiny_budget_and_matches_an_unpreempted_run(
        tiny_llama, make_llm, mode):
    """The engine core in its own process (serve's default) with an int8 cache of 30 blocks
    where every request grows to 27 (108 tokens): any two that run at once preempt one of
    them (swapped out with its scales, or recomputed), however the requests' arrival
    interleaves with the core's steps. The prompts take at most 4 blocks, so a request that
    arrives while another runs is admitted until that one has nearly all its blocks (prompts of
    up to 25 blocks were held back once the first had grown past 5, and a core that started a
    request before the frontend sent the next could then run them one after another).
    Every request's tokens equal an in-process int8 engine's that had room for all of them;
    every block comes back."""
    from pagedkv import LLM

    prompts = make_prompts(seed=5, vocab=400, shared_prefix=4, lengths=(3, 9))
    params = [SamplingParams(temperature=0.0, max_tokens=108 - len(p), ignore_eos=True)
              for p in prompts]
    roomy = make_llm(tiny_llama, block_size=4, kv_cache_dtype="int8", cpu_threads=1)
    want = [list(o.outputs[0].token_ids) for o in _generate(roomy, prompts, params)]
    assert roomy.llm_engine.get_stats().num_preemptions == 0
    tight = LLM(str(tiny_llama), core_process=True, seed=0, block_size=4, kv_cache_dtype="int8",
                num_gpu_blocks_override=30, preemption_mode=mode, swap_space=0.01, cpu_threads=1)
    try:
        got = [list(o.outputs[0].token_ids) for o in _generate(tight, prompts, params)]
        stats = tight.llm_engine.get_stats()
        tight.llm_engine.check_invariants()
    finally:
        tight.shutdown()
    assert got == want
    assert stats.num_preemptions > 0 and (stats.num_swaps > 0) == (mode == "swap")
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks


@pytest.mark.parametrize("dtype, cache_dtype", [("bfloat16", "float32"), ("float16", "float32"),
                                                ("float16", "bfloat16")])
def test_a_cache_of_another_float_dtype_than_the_weights(tiny_llama, make_llm, dtype,
                                                         cache_dtype):
    """kv_cache_dtype naming a float dtype other than the model's (it crashed: the cache's
    clamp limit overflowed the narrower values' dtype). A wider cache holds the values
    exactly: its tokens and logprobs equal the model dtype cache's; bfloat16 under float16
    weights (fewer mantissa bits) keeps the greedy tokens on this model."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    prompts = make_prompts(seed=6, vocab=400, num=3)
    runs = []
    for cache in ("auto", cache_dtype):
        llm = make_llm(tiny_llama, dtype=dtype, block_size=4, kv_cache_dtype=cache)
        outs = _generate(llm, prompts, params)
        runs.append([(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs])
    assert runs[0] == runs[1] if cache_dtype == "float32" else \
        [t for t, _ in runs[0]] == [t for t, _ in runs[1]]
