"""Fixtures for tests, demos and benchmarks: random-weight Hugging Face model directories."""

from pagedkv.testing.random_model import build_random_model_dir, build_tokenizer_files

__all__ = ["build_random_model_dir", "build_tokenizer_files"]
