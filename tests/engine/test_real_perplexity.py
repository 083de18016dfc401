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
from pagedkv.model.gguf.config import hf_config
from pagedkv.model.gguf.file import open_gguf
from pagedkv.model.gguf.tensors import GGUFCheckpoint
from pagedkv.model.tokenizer import Tokenizer

pytestmark = pytest.mark.real_model

TEXT = Path(__file__).resolve().parent.parent / "data" / "declaration_of_independence.txt"
NUM_TOKENS = 512  # the text's first 512 tokens (2.4 KB): seconds of model time on a CPU


def transformers_model(path: Path) -> torch.nn.Module:
    """transformers' own model class (float32, eager attention) holding the file's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(hf_config(open_gguf(path)))
    config.pop("architectures")
    config = AutoConfig.for_model(**config)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    checkpoint = GGUFCheckpoint(open_gguf(path))
    state = {name: checkpoint.get_tensor(name) for name in list(checkpoint.keys())}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def transformers_token_logprobs(path: Path, tokens: list[int]) -> list[float]:
    """log p(token i | tokens before it) for i >= 1, by transformers."""
    with torch.no_grad():
        logits = transformers_model(path)(torch.tensor([tokens])).logits[0].double()
    logprobs = logits.log_softmax(-1)[:-1]
    return logprobs.gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).squeeze(1).tolist()


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def test_real_model_perplexity_equals_transformers(real_model_path, make_llm):
    tokens = Tokenizer.from_dir(real_model_path).encode(TEXT.read_text())[:NUM_TOKENS]
    assert len(tokens) == NUM_TOKENS
    llm = make_llm(real_model_path, dtype="float32", max_model_len=NUM_TOKENS + 16)
    out = llm.generate({"prompt_token_ids": tokens},
                       SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None
    got = [entry[token] for entry, token in zip(out.prompt_logprobs[1:], tokens[1:], strict=True)]
    ref = transformers_token_logprobs(real_model_path, tokens)
    assert perplexity(got) == pytest.approx(perplexity(ref), rel=1e-3)
    # Per token too: the perplexity is no average of errors that cancel.
    assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) < 1e-3
    # A trained model on English: far below a uniform guess over the vocabulary (49,152), and
    # far below what random weights give (thousands).
    assert perplexity(ref) < 50
