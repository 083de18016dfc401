"""The model runtime: HF loading, Llama-family models on paged KV, sampler, ModelRunner.

The package's names load on first use (PEP 562), so `pagedkv.model.tokenizer` can be imported
without torch (the router tokenizes, it never runs a model)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedkv.model.config import ModelConfig
    from pagedkv.model.runner import ModelRunner
    from pagedkv.model.tokenizer import Tokenizer

__all__ = ["ModelConfig", "ModelRunner", "Tokenizer"]
_HOMES = {"ModelConfig": "pagedkv.model.config", "ModelRunner": "pagedkv.model.runner",
          "Tokenizer": "pagedkv.model.tokenizer"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'pagedkv.model' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
