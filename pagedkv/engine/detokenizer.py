"""Incremental detokenization with stop strings.

Byte-level tokenizers can split one character over several tokens; decoding token by token would
then emit U+FFFD halves. We decode a short window (`prefix_offset:`) and only emit text once it no
longer ends in an incomplete character, as vLLM's `detokenize_incrementally` does.
"""

from __future__ import annotations

from typing import Protocol

# Tokens decoded before the read offset to give the tokenizer context for spacing.
_CONTEXT_TOKENS = 5


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
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self.stopped = False

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string found in the new text, else None."""
        if self.stopped:
            return None
        self._ids.extend(new_token_ids)
        decode = self.tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        full = decode(self._ids[self._prefix_offset:], self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # wait for the rest of a multi-byte character
        delta = full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Keep the window short: everything before the prefix offset is already text.
        if self._prefix_offset > 64:
            self._ids = self._ids[self._prefix_offset:]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return self._append(delta)

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
        start = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += delta
        hits = [(at, stop) for stop in self.stop if (at := self.text.find(stop, start)) != -1]
        if not hits:
            return None
        at, stop = min(hits)  # the earliest stop string wins
        self.text = self.text[:at + len(stop)] if self.include_stop else self.text[:at]
        self.stopped = True
        return stop
