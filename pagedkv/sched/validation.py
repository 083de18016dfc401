"""Checks of the values a request carries that `step()` would otherwise trip over later.

Each raises ValueError naming the value, at `SamplingParams` / `add_request` time, so a bad
request is refused alone instead of failing the step that holds every queued request.
"""

from __future__ import annotations

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # torch generators take 64-bit seeds (seed + i, too)
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1  # the server's bound as well

# Bounds of a request's list fields (the server's as well), so that no field makes one
# request cost the others more than a small bound: each is checked, reduced or turned into
# token ids once, and the per-step work it causes grows with these caps, never with the input.
MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 64
MAX_BAD_WORDS = 128
MAX_TEXT_LIST_BYTES = 16 * 1024  # of all stop strings together, and of all bad words
MAX_LOGIT_BIAS = 1024
# allowed_token_ids as sent (duplicates included): above any vocabulary's size; the list is
# reduced to its sorted distinct ids once, and ids past the vocabulary are refused.
MAX_ALLOWED_TOKEN_IDS = 2**18


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


def check_text_list(texts: list[str], name: str, max_count: int) -> None:
    """ValueError naming the limit when `texts` has more than `max_count` strings or more than
    MAX_TEXT_LIST_BYTES bytes of UTF-8 together (each must be valid Unicode)."""
    if len(texts) > max_count:
        raise ValueError(f"{name} has {len(texts)} strings, more than the limit of {max_count}")
    size = 0
    for text in texts:
        check_text(text, name)
        size += len(text.encode("utf-8"))
        if size > MAX_TEXT_LIST_BYTES:
            raise ValueError(f"{name} has more than {MAX_TEXT_LIST_BYTES} bytes of text "
                             f"together, the limit")


def check_max_count(count: int, name: str, max_count: int, what: str = "entries") -> None:
    """ValueError naming the limit when a list field has more than `max_count` entries."""
    if count > max_count:
        raise ValueError(f"{name} has {count} {what}, more than the limit of {max_count}")


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
