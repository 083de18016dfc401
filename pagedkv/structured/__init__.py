"""Structured outputs: JSON schema, regex, choice and grammar constraints (vLLM's names).

`params.py` says what a request asks for (pure Python); `backend.py` compiles it with xgrammar
(once per constraint, cached) into a per-request `grammar.py` state; `bitmask.py` masks the
logits of a batch with those states' allowed tokens.
"""

from pagedkv.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
