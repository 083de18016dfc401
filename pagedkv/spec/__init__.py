"""Speculative decoding: proposers of draft tokens, which the target model verifies.

A proposer is one file with a class built from the `SpeculativeConfig` and a
`propose(tokens, max_tokens) -> list[int]` method; `PROPOSERS` maps `speculative_config`'s
`method` to it (a new method is a new file, one line here and its keys in config.py's
`_METHOD_KEYS`). The scheduler asks the proposer
after each decode step and schedules the proposal with the next token (sched/scheduler.py);
the runner verifies it (rejection.py).
"""

from __future__ import annotations

import importlib
from typing import Protocol

from pagedkv.spec.config import SpeculativeConfig, parse_speculative_config

PROPOSERS: dict[str, str] = {
    "ngram": "pagedkv.spec.ngram:NgramProposer",
}


class Proposer(Protocol):
    def propose(self, tokens: list[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` draft tokens to follow `tokens` (prompt + output)."""
        ...


def build_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer of `config.method` (imported on first use)."""
    module, name = PROPOSERS[config.method].split(":")
    return getattr(importlib.import_module(module), name)(config)


__all__ = ["PROPOSERS", "Proposer", "SpeculativeConfig", "build_proposer",
           "parse_speculative_config"]
