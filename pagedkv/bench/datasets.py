"""Synthetic serving workloads, as token-id prompts (so input lengths are exact).

- `random`: each prompt is `input_len` random token ids (lengths spread by `range_ratio`).
- `shared-prefix`: one random `prefix_len`-token prefix shared by every prompt, then
  `input_len` random tokens of its own (what a system prompt looks like to a prefix cache).

Token ids are drawn from [FIRST_TOKEN_ID, vocab_size), skipping the low ids where tokenizers
keep their special tokens. Everything is deterministic in `seed`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("random", "shared-prefix")
FIRST_TOKEN_ID = 10


@dataclass(frozen=True)
class SampleRequest:
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _tokens(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(count)]


def sample_requests(dataset: str, *, num_prompts: int, input_len: int, output_len: int,
                    vocab_size: int, prefix_len: int = 0, range_ratio: float = 0.0,
                    seed: int = 0) -> list[SampleRequest]:
    """`num_prompts` requests of `dataset` (see the module docstring).

    Raises ValueError naming a bad argument.
    """
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
    for name, value in (("num_prompts", num_prompts), ("input_len", input_len),
                        ("output_len", output_len)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len!r}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio!r}")
    if vocab_size <= FIRST_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {FIRST_TOKEN_ID}, got {vocab_size!r}")
    rng = random.Random(seed)
    prefix = _tokens(rng, prefix_len, vocab_size) if dataset == "shared-prefix" else []
    low = max(1, int(input_len * (1 - range_ratio)))
    high = max(low, int(input_len * (1 + range_ratio)))
    return [SampleRequest(prefix + _tokens(rng, rng.randint(low, high), vocab_size), output_len)
            for _ in range(num_prompts)]


def shared_trace(name: str) -> Path:
    """A public trace in the project's `shared/traces/` (beside the checkout, as the developers'
    machines and CI lay it out; README there), e.g. "mooncake_conversation_trace.jsonl"."""
    return Path(__file__).resolve().parents[2].parent / "shared" / "traces" / name
