"""Incremental detokenization with stop strings.

Byte-level tokenizers can split one character over several tokens; decoding token by token would
then emit U+FFFD halves. We decode a short window (`prefix_offset:`) and only emit text once it no
longer ends in an incomplete character, as vLLM's `detokenize_incrementally` does. With a
tokenizer that offers `decode_stream` (pagedkv's, over `tokenizers.DecodeStream`) that window is
decoded inside one call per token, as vLLM's fast incremental detokenizer does; otherwise by two
`decode` calls per update (the slow path).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

# Prompt tokens decoded before the output to give the tokenizer context for spacing: the
# shortest suffix of at least _CONTEXT_TOKENS (at most _MAX_CONTEXT_TOKENS) that decodes to whole
# characters (a suffix cut inside a character would leak into the output), as vLLM primes.
_CONTEXT_TOKENS = 5
_MAX_CONTEXT_TOKENS = 24


def prompt_context(decoder: _Decoder, prompt_token_ids: list[int],
                   skip_special_tokens: bool) -> list[int]:
    """The prompt suffix that primes a sequence's detokenizer ([] when none decodes cleanly)."""
    if len(prompt_token_ids) <= _CONTEXT_TOKENS:
        suffix = list(prompt_token_ids)
        return suffix if "\ufffd" not in decoder.decode(suffix, skip_special_tokens) else []
    for length in range(_CONTEXT_TOKENS, min(len(prompt_token_ids), _MAX_CONTEXT_TOKENS) + 1):
        suffix = prompt_token_ids[-length:]
        if "\ufffd" not in decoder.decode(suffix, skip_special_tokens):
            return list(suffix)
    return []


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text, a few tokens at a time.

    `text` is the output text so far (stop strings are cut off unless
    `include_stop_str_in_output`). `update()` returns the stop string that ended the text, if any.
    """

    def __init__(self, tokenizer: _Decoder, prompt_token_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in stop), default=0)
        # The window starts inside the prompt so the first output token decodes with context.
        self._ids: list[int] = prompt_context(tokenizer, prompt_token_ids, skip_special_tokens)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self.stopped = False
        make_stream = getattr(tokenizer, "decode_stream", None)
        self._stream: Callable[[int | list[int]], str | None] | None = (
            None if make_stream is None else make_stream(self._ids, skip_special_tokens))

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string found in the new text, else None. Mutates
        the window, `text` and `stopped`. O(new tokens) (plus the `str` append of `text`)."""
        if self.stopped:
            return None
        ids = self._ids
        ids += new_token_ids
        stream = self._stream
        if stream is not None:  # one call into tokenizers (the fast path)
            delta = stream(new_token_ids[0] if len(new_token_ids) == 1 else new_token_ids)
        else:
            delta = self._decode_new()
        if delta is None:
            return None  # wait for the rest of a multi-byte character
        prefix = self._read_offset
        if prefix > 64:  # keep the window short: everything before it is text already
            del ids[:prefix]
            prefix = 0
        self._prefix_offset = prefix
        self._read_offset = len(ids)
        if not self.stop:
            self.text += delta
            return None
        return self._append(delta)

    def _decode_new(self) -> str | None:
        """(The slow path, two decodes) the text the new tokens complete, or None while a
        character is incomplete."""
        decode = self.tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        full = decode(self._ids[self._prefix_offset:], self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        return full[len(prefix):]

    def flush(self) -> None:
        """The sequence ended: emit what is held back up to its last complete character. The
        bytes of a character that `max_tokens` (or a stop token) cut are left out, never
        written as U+FFFD, as vLLM leaves them out. (vLLM also drops complete characters
        decoded in the same held-back window; they are real output, so we keep them.)"""
        if self.stopped:
            return
        decode = self.tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        full = decode(self._ids[self._prefix_offset:], self.skip_special_tokens)
        if len(full) > len(prefix):
            self._prefix_offset = self._read_offset = len(self._ids)
            delta = full[len(prefix):].rstrip("\ufffd")
            if delta:
                self._append(delta)

    def _append(self, delta: str) -> str | None:
        if not self.stop:
            self.text += delta
            return None
        start = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += delta
        hits = [(at, stop) for stop in self.stop if (at := self.text.find(stop, start)) != -1]
        if not hits:
            return None
        at, stop = min(hits)  # the earliest stop string wins
        self.text = self.text[:at + len(stop)] if self.include_stop else self.text[:at]
        self.stopped = True
        return stop
