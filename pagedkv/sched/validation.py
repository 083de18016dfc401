"""Checks of the values a request carries that `step()` would otherwise trip over later.

Each raises ValueError naming the value, at `SamplingParams` / `add_request` time, so a bad
request is refused alone instead of failing the step that holds every queued request.
"""

from __future__ import annotations

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # torch generators take 64-bit seeds (seed + i, too)
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1  # the server's bound as well


def is_int(value: object) -> bool:
    """An int that is not a bool (`True` is an int to Python, never a count to us)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_text(text: str, name: str) -> None:
    """Raise ValueError when `text` is not valid Unicode: a lone surrogate such as "\\ud800"
    (JSON lets one through) has no UTF-8 form, so tokenizers and hashes cannot take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name} is not valid Unicode text: it holds a lone surrogate "
                         f"{text[exc.start]!r} at index {exc.start}") from None


def check_seed(seed: object) -> None:
    if seed is not None and not (is_int(seed) and SEED_MIN <= seed <= SEED_MAX):
        raise ValueError(f"seed must be an integer in [-2**63, 2**63 - 1] or None, got {seed!r}")


def check_priority(priority: object) -> None:
    if not (is_int(priority) and PRIORITY_MIN <= priority <= PRIORITY_MAX):
        raise ValueError(f"priority must be an integer in [-2**31, 2**31 - 1], got {priority!r}")


def check_cache_salt(cache_salt: object) -> None:
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string, got {cache_salt!r}")
    check_text(cache_salt, "cache_salt")


class PromptTooLongError(ValueError):
    """A text has more tokens than allowed; `num_tokens` is a lower bound of its count (the
    exact count when the whole text was tokenized)."""

    def __init__(self, num_tokens: int, max_tokens: int, what: str = "prompt") -> None:
        super().__init__(f"the {what} has at least {num_tokens} tokens, more than the "
                         f"{max_tokens} allowed")
        self.num_tokens = num_tokens
        self.max_tokens = max_tokens
