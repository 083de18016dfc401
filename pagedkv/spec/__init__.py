"""Speculative decoding: proposers of draft tokens, which the target model verifies.

A proposer is one file with a class built from the `SpeculativeConfig` and a
`propose(tokens, max_tokens) -> list[int]` method; `PROPOSERS` maps `speculative_config`'s
`method` to it (a new method is a new file, one line here and its keys in config.py's
`_METHOD_KEYS`). The scheduler asks the proposer
after each decode step and schedules the proposal with the next token (sched/scheduler.py);
the runner verifies it (rejection.py).

A proposer that keeps state per request (the draft model's own KV cache, method
"draft_model") is a `RequestProposer`: it proposes for the whole batch at once and is told
when a request's state must go (finished, aborted, preempted). It runs a model, which this
layer may not import: the engine builds it (engine/compose.py) and hands it to the Scheduler.
"""

from __future__ import annotations

import importlib
from typing import Protocol, runtime_checkable

from pagedkv.spec.config import SpeculativeConfig, parse_speculative_config

PROPOSERS: dict[str, str] = {
    "ngram": "pagedkv.spec.ngram:NgramProposer",
}


class Proposer(Protocol):
    def propose(self, tokens: list[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` draft tokens to follow `tokens` (prompt + output)."""
        ...


@runtime_checkable
class RequestProposer(Protocol):
    def propose_batch(self, requests: list[tuple[str, list[int], int]]) -> list[list[int]]:
        """For each (request id, prompt + output tokens, max draft tokens): up to that many
        draft tokens to follow the tokens."""
        ...

    def forget(self, request_id: str) -> None:
        """Drop `request_id`'s state (its KV blocks); unknown ids are ignored."""
        ...


# Methods whose proposer runs a model: built by the engine (engine/compose.py), not here.
ENGINE_BUILT = {"draft_model"}


def build_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer of `config.method` (imported on first use). ValueError for a method the
    engine builds (`ENGINE_BUILT`)."""
    if config.method in ENGINE_BUILT:
        raise ValueError(f"speculative_config.method {config.method!r} runs a model: the "
                         "engine builds its proposer and passes it to the Scheduler")
    module, name = PROPOSERS[config.method].split(":")
    return getattr(importlib.import_module(module), name)(config)


__all__ = ["ENGINE_BUILT", "PROPOSERS", "Proposer", "RequestProposer", "SpeculativeConfig", "build_proposer",
           "parse_speculative_config"]
