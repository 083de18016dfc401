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

from pagedkv.testing.hf_reference import gguf_state_dict, transformers_model
from tests.engine.conftest import make_llm  # noqa: F401 (the LLM factory, as a fixture here)

# Short prompts, few tokens: the whole real-model set stays within the suite's time budget.
PROMPTS = ["The capital of France is", "Water boils at a temperature of",
           "The three primary colors are"]
MAX_TOKENS = 8
TOP = 3


@pytest.fixture(scope="session")
def real_state_dict(real_model_path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors under Hugging Face names, dequantized (pagedkv's reader)."""
    return gguf_state_dict(real_model_path)


@pytest.fixture(scope="session")
def hf_real_model(real_model_path: Path, real_state_dict: dict[str, torch.Tensor]
                  ) -> torch.nn.Module:
    """transformers' model (float32, eager attention) holding the file's weights."""
    return transformers_model(real_model_path, real_state_dict)


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
