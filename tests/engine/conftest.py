"""Engine test helpers: prompts, transformers' greedy reference, and an LLM factory that checks
the block pool after every use."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pagedkv import LLM
from tests.tiny_models import load_hf_model

_REFERENCE_CACHE: dict[tuple, list[int]] = {}


def make_prompts(seed: int, vocab: int, num: int = 6, shared_prefix: int = 40,
                 lengths: tuple[int, int] = (5, 60)) -> list[list[int]]:
    """Token-id prompts; half of them share a `shared_prefix`-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(4, vocab) for _ in range(shared_prefix)]
    prompts = []
    for i in range(num):
        body = [rng.randrange(4, vocab) for _ in range(rng.randint(*lengths))]
        prompts.append(prefix + body if i % 2 == 0 else body)
    return prompts


def hf_greedy(model_dir: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation (full forward each step: a plain, obviously right loop)."""
    key = (str(model_dir), tuple(prompt), max_tokens)
    if key not in _REFERENCE_CACHE:
        model = _hf_model(model_dir)
        ids = torch.tensor([prompt])
        out = []
        with torch.no_grad():
            for _ in range(max_tokens):
                token = int(model(ids).logits[0, -1].argmax())
                out.append(token)
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        _REFERENCE_CACHE[key] = out
    return _REFERENCE_CACHE[key]


_HF_MODELS: dict[str, object] = {}


def _hf_model(model_dir: Path):
    if str(model_dir) not in _HF_MODELS:
        _HF_MODELS[str(model_dir)] = load_hf_model(model_dir)
    return _HF_MODELS[str(model_dir)]


def assert_pool_empty(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.check_invariants()
    kv = engine.scheduler.kv_cache_manager
    assert not engine.has_unfinished_requests()
    assert kv.usage == 0.0
    assert kv.num_free_blocks == kv.num_usable_blocks
    if kv.host_pool is not None:
        assert kv.host_pool.get_num_free_blocks() == kv.host_pool.num_usable_blocks


@pytest.fixture
def make_llm():
    """LLM factory; every LLM built through it is checked for an empty, consistent pool at the
    end, then shut down. Without an explicit KV size it gets a small budget (64 MiB), so tests
    behave alike on CPU and GPU and never take a whole GPU."""
    built: list[LLM] = []

    def factory(model_dir: Path, **kwargs) -> LLM:
        kwargs.setdefault("seed", 0)
        if "num_gpu_blocks_override" not in kwargs:
            kwargs.setdefault("kv_cache_memory_bytes", 64 << 20)
        llm = LLM(model=str(model_dir), **kwargs)
        built.append(llm)
        return llm

    yield factory
    for llm in built:
        assert_pool_empty(llm)
        llm.shutdown()
