"""pagedkv: a paged-KV-cache LLM inference and serving engine.

`from pagedkv import LLM, SamplingParams` mirrors vLLM's entry points. The heavy pieces (torch,
the model runtime) load lazily, so `pagedkv.kv` stays importable without torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "pagedkv.engine.llm",
    "LLMEngine": "pagedkv.engine.llm_engine",
    "EngineArgs": "pagedkv.engine.args",
    "RequestOutput": "pagedkv.engine.outputs",
    "CompletionOutput": "pagedkv.engine.outputs",
    "SamplingParams": "pagedkv.sched.sampling_params",
    "BeamSearchParams": "pagedkv.sched.sampling_params",
    "StructuredOutputsParams": "pagedkv.structured.params",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
