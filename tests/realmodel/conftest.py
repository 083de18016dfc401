"""The real model's reference: transformers' Llama on the same weights.

The reference model is transformers' own `LlamaForCausalLM` (float32, eager attention), built
from the config and tensors pagedkv reads from the GGUF file. That they are the file's, read
right, is checked against transformers' own GGUF reader (`load_gguf_checkpoint`, what
`from_pretrained(dir, gguf_file=...)` calls; that call itself needs `accelerate`, not a
dependency here) in test_gguf_reading.py, once: tensor for tensor, bit for bit. transformers'
reader takes several seconds per parse (GGUFReader builds a numpy view per vocabulary token),
so it is not run again for every fixture.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedkv import LLM
from pagedkv.testing.hf_reference import gguf_state_dict, transformers_model
from tests.engine.conftest import (
    assert_pool_empty,
    make_llm,  # noqa: F401 (the LLM factory, as a fixture here)
)

# Short prompts, few tokens: the whole real-model set stays within the suite's time budget.
PROMPTS = ["The capital of France is", "Water boils at a temperature of",
           "The three primary colors are"]
MAX_TOKENS = 8
TOP = 3
# The perplexity test's prompt: the text's first 512 tokens (2.4 KB), seconds of model time.
PERPLEXITY_TOKENS = 512


@pytest.fixture(scope="session")
def real_state_dict(real_model_path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors under Hugging Face names, dequantized (pagedkv's reader)."""
    return gguf_state_dict(real_model_path)


@pytest.fixture(scope="session")
def hf_real_model(real_model_path: Path, real_state_dict: dict[str, torch.Tensor]
                  ) -> torch.nn.Module:
    """transformers' model (float32, eager attention) holding the file's weights."""
    return transformers_model(real_model_path, real_state_dict)


@pytest.fixture(scope="session")
def shared_real_llm(real_model_path: Path):
    """One engine on the real model for the tests that need no particular memory setting (an
    engine on it takes CPU-seconds to load and warm up): room for the perplexity prompt and
    to spare. Its pool ends empty."""
    llm = LLM(str(real_model_path), dtype="float32", block_size=4,
              max_model_len=PERPLEXITY_TOKENS + 16, num_gpu_blocks_override=136, seed=0)
    yield llm
    assert_pool_empty(llm)
    llm.shutdown()


@pytest.fixture
def real_llm(shared_real_llm: LLM):
    """`shared_real_llm` as a fresh engine would be: an empty, consistent pool and nothing in
    the prefix cache before the test; the pool empty and consistent again after it."""
    assert_pool_empty(shared_real_llm)
    assert shared_real_llm.llm_engine.scheduler.kv_cache_manager.reset_prefix_cache()
    yield shared_real_llm
    assert_pool_empty(shared_real_llm)


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation (a full forward per token: plainly right)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def hf_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab] log-probabilities transformers gives each output position."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1:-1].double(), dim=-1)


def assert_logprobs_match(reference: torch.Tensor, output: list[int],
                          entries: list[dict[int, float]], top: int = TOP) -> None:
    """Each position's returned logprobs (sampled token and top-N) equal the reference's."""
    assert len(entries) == len(output)
    for i, (token, entry) in enumerate(zip(output, entries, strict=True)):
        ref = reference[i]
        assert set(entry) == {*ref.topk(top).indices.tolist(), token}, i
        for token_id, value in entry.items():
            assert value == pytest.approx(float(ref[token_id]), abs=2e-4), (i, token_id)
