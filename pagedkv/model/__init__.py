"""The model runtime: HF loading, Llama-family models on paged KV, sampler, ModelRunner."""

from pagedkv.model.config import ModelConfig
from pagedkv.model.runner import ModelRunner
from pagedkv.model.tokenizer import Tokenizer

__all__ = ["ModelConfig", "ModelRunner", "Tokenizer"]
