"""The real model's perplexity on a public-domain text (tests/data/README.md): pagedkv's prompt
logprobs against transformers' Llama holding the same weights (the GGUF file's tensors as
pagedkv reads them; that those are the file's, bit for bit as transformers' own GGUF reader
gives them, is the GGUF reading tests' job)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pagedkv import SamplingParams
from pagedkv.model.tokenizer import Tokenizer
from tests.realmodel.conftest import PERPLEXITY_TOKENS as NUM_TOKENS

pytestmark = pytest.mark.real_model

TEXT = Path(__file__).resolve().parent.parent / "data" / "declaration_of_independence.txt"


def transformers_token_logprobs(model: torch.nn.Module, tokens: list[int]) -> list[float]:
    """log p(token i | tokens before it) for i >= 1, by transformers."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    logprobs = logits.log_softmax(-1)[:-1]
    return logprobs.gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).squeeze(1).tolist()


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def test_real_model_perplexity_equals_transformers(real_model_path, hf_real_model, real_llm):
    tokens = Tokenizer.from_dir(real_model_path).encode(TEXT.read_text())[:NUM_TOKENS]
    assert len(tokens) == NUM_TOKENS
    out = real_llm.generate({"prompt_token_ids": tokens},
                       SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None
    got = [entry[token] for entry, token in zip(out.prompt_logprobs[1:], tokens[1:], strict=True)]
    ref = transformers_token_logprobs(hf_real_model, tokens)
    assert perplexity(got) == pytest.approx(perplexity(ref), rel=1e-3)
    # Per token too: the perplexity is no average of errors that cancel.
    assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) < 1e-3
    # A trained model on English: far below a uniform guess over the vocabulary (49,152), and
    # far below what random weights give (thousands).
    assert perplexity(ref) < 50
