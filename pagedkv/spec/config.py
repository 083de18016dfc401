"""SpeculativeConfig: vLLM's `speculative_config`, parsed and checked once.

Given as a JSON object on the command line (`--speculative-config '{"method": "ngram",
"num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'`) or as a dict
(`LLM(..., speculative_config={...})`). `method` names a proposer of the registry
(pagedkv/spec/__init__.py); a bad value is a ValueError naming the key and the value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedkv.config.json_option import json_object

# The keys each method takes besides `method` and `num_speculative_tokens`.
_METHOD_KEYS = {"ngram": {"prompt_lookup_min", "prompt_lookup_max"}, "draft_model": {"model"}}
MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """`num_speculative_tokens` (k) tokens proposed per decode step by `method`; for "ngram",
    the n-gram lengths looked up, longest first (`prompt_lookup_max` down to `_min`); for
    "draft_model", the draft model's directory (`model`), which shares the target's vocab."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 1
    model: str | None = None


def _positive_int(key: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative_config.{key} must be a positive integer, got {value!r}")
    return value


def _draft_model_dir(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"speculative_config.model must be the draft model's directory, "
                         f"got {value!r}")
    return value


def parse_speculative_config(value: str | dict | SpeculativeConfig | None
                             ) -> SpeculativeConfig | None:
    """The config `value` describes (None: no speculation). ValueError naming the bad key."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    value = json_object("speculative_config", value)
    method = value.get("method")
    if method not in _METHOD_KEYS:
        raise ValueError(f"speculative_config.method must be one of {sorted(_METHOD_KEYS)}, "
                         f"got {method!r}")
    unknown = set(value) - {"method", "num_speculative_tokens"} - _METHOD_KEYS[method]
    if unknown:
        raise ValueError(f"speculative_config has unknown keys {sorted(unknown)} for method "
                         f"{method!r}")
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config.num_speculative_tokens is required")
    k = _positive_int("num_speculative_tokens", value["num_speculative_tokens"])
    if k > MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"speculative_config.num_speculative_tokens must be <= "
                         f"{MAX_SPECULATIVE_TOKENS}, got {k!r}")
    if method == "draft_model":
        return SpeculativeConfig(method, k, model=_draft_model_dir(value.get("model")))
    low = _positive_int("prompt_lookup_min", value.get("prompt_lookup_min", 1))
    high = _positive_int("prompt_lookup_max", value.get("prompt_lookup_max", max(low, 1)))
    if low > high:
        raise ValueError(f"speculative_config.prompt_lookup_min ({low}) must be <= "
                         f"prompt_lookup_max ({high})")
    return SpeculativeConfig(method, k, low, high)
