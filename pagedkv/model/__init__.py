"""The model runtime: HF loading, Llama-family models on paged KV, sampler, ModelRunner."""

from pagedkv.model.config import ModelConfig
from pagedkv.model.random_model import build_random_model_dir, build_tokenizer_files
from pagedkv.model.runner import ModelRunner
from pagedkv.model.tokenizer import Tokenizer

__all__ = ["ModelConfig", "ModelRunner", "Tokenizer", "build_random_model_dir",
           "build_tokenizer_files"]
