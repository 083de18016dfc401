"""Incremental detokenization with stop strings, by vLLM 0.32's rule.

Byte-level tokenizers can split one character over several tokens. vLLM's detokenizer
(tokenizers' `DecodeStream`, one `step` per token) decodes a short window of tokens and emits
the new text only when the window's text grew and does not end in U+FFFD (an unfinished or
invalid byte sequence); otherwise the token is held back in the window. Nothing is emitted at
the end: when `max_tokens` cuts a sequence, the held-back window is left out whole (complete
characters decoded in it included), and so is everything after an invalid byte that the window
never got past. A token that ends a sequence as a stop token (eos, `stop_token_ids`) is not
decoded unless `include_stop_str_in_output`. Stop strings are looked for once `min_tokens`
tokens are out, the one that ends first wins. With `skip_special_tokens` and
`spaces_between_special_tokens` both false, an added token right after another is written as
its bare content. With a tokenizer that offers `decode_stream` (pagedkv's, over
`tokenizers.DecodeStream`) a token costs one call into `tokenizers`; otherwise the same rule
runs over `decode` (the slow path, `_WindowStep`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

# Prompt tokens decoded before the output to give the tokenizer context for spacing: the
# shortest suffix of at least _CONTEXT_TOKENS (at most _MAX_CONTEXT_TOKENS) that decodes to whole
# characters, as vLLM's slow path primes (its fast path primes with the whole prompt: the same
# text, see `prompt_context`).
_CONTEXT_TOKENS = 5
_MAX_CONTEXT_TOKENS = 24
# tokenizers' DecodeStream error when a window's text no longer starts with the text it had
# (vLLM then restarts the stream without context).
_INVALID_PREFIX = "Invalid prefix encountered"
_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def prompt_context(decoder: _Decoder, prompt_token_ids: list[int],
                   skip_special_tokens: bool) -> tuple[list[int], int]:
    """(context, repeated): `context` is the prompt suffix that primes a sequence's decode
    stream, the shortest of at least _CONTEXT_TOKENS (at most _MAX_CONTEXT_TOKENS) whose text
    has no U+FFFD before its end (else the shortest); `repeated` how many characters of prompt
    text the stream's first text repeats (0 unless the prompt ends in an unfinished character).

    vLLM primes its DecodeStream with the whole prompt: the same text for what follows, as a
    decode stream's text depends only on the tokens near its end. When the prompt ends in an
    unfinished character the stream has no prefix yet and its first text repeats the prompt
    (vLLM's output then starts with the whole prompt); that repeated prompt text, all of the
    context's text but its last U+FFFD (the unfinished bytes, which the output completes), is
    what the caller leaves out."""
    ids = prompt_token_ids
    decode = decoder.decode
    context = ids[-_CONTEXT_TOKENS:]
    text = decode(context, skip_special_tokens)
    if _REPLACEMENT in text[:-1]:
        for length in range(_CONTEXT_TOKENS + 1, min(len(ids), _MAX_CONTEXT_TOKENS) + 1):
            longer = decode(ids[-length:], skip_special_tokens)
            if _REPLACEMENT not in longer[:-1]:
                context, text = ids[-length:], longer
                break
    return list(context), len(text) - 1 if text.endswith(_REPLACEMENT) else 0


class _WindowStep:
    """The slow path: tokenizers' `DecodeStream.step` written over `decode` (the same window,
    prefix and prefix index; a prompt context whose text ends in U+FFFD leaves the prefix
    empty), with the same invalid-prefix restart."""

    __slots__ = ("_decode", "_skip", "_ids", "_prefix", "_prefix_index")

    def __init__(self, decoder: _Decoder, context: list[int], skip_special_tokens: bool) -> None:
        self._decode = decoder.decode
        self._skip = skip_special_tokens
        self._ids = list(context)
        self._prefix = ""
        self._prefix_index = 0

    def __call__(self, token: int) -> str:
        ids, decode, skip = self._ids, self._decode, self._skip
        if not self._prefix and ids:  # (the stream's prefill)
            prefix = decode(ids, skip)
            if not prefix.endswith(_REPLACEMENT):
                self._prefix, self._prefix_index = prefix, len(ids)
        ids.append(token)
        text = decode(ids, skip)
        prefix = self._prefix
        if len(text) <= len(prefix) or text.endswith(_REPLACEMENT):
            return ""
        if not text.startswith(prefix):  # restart without context
            self._ids, self._prefix, self._prefix_index = [], "", 0
            return self(token)
        next_index = len(ids) - self._prefix_index
        del ids[:self._prefix_index]
        self._prefix, self._prefix_index = decode(ids, skip), next_index
        return text[len(prefix):]


class _AddedTokensJoined:
    """Wraps a step (vLLM's `spaces_between_special_tokens=False`): an added token right after
    another is written as its content, without the space the decoder may put before it."""

    __slots__ = ("_step", "_added", "_last_added")

    def __init__(self, step: Callable[[int], str | None], added: dict[int, str]) -> None:
        self._step, self._added, self._last_added = step, added, False

    def __call__(self, token: int) -> str | None:
        text = self._step(token)
        content = self._added.get(token)
        if content is not None and self._last_added:
            text = content
        self._last_added = content is not None
        return text


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text, a token at a time (vLLM's rule, see the
    module docstring).

    `text` is the output text so far (stop strings are cut off unless
    `include_stop_str_in_output`). `update()` returns the stop string that ended the text, if any.
    """

    def __init__(self, tokenizer: _Decoder, prompt_token_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, include_stop_str_in_output: bool = False,
                 min_tokens: int = 0, spaces_between_special_tokens: bool = True) -> None:
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.num_tokens = 0
        self.text = ""
        self.stopped = False
        self._skip_special = skip_special_tokens
        added = getattr(tokenizer, "added_tokens", None)
        self._added = None if skip_special_tokens or spaces_between_special_tokens else added
        # The fast path steps tokenizers' DecodeStream (one call per token, the new text or
        # None while held back); the slow path the same rule over `decode`.
        self._make_stream = getattr(tokenizer, "decode_stream", None)
        context, repeated = prompt_context(tokenizer, prompt_token_ids, skip_special_tokens)
        step: Callable[[int], str | None] = (
            _WindowStep(tokenizer, context, skip_special_tokens) if self._make_stream is None
            else self._make_stream(context, skip_special_tokens))
        self._inner = self._wrapped(step)
        self._repeated = repeated
        self._step = self._skip_repeated if repeated else self._inner

    def _skip_repeated(self, token: int) -> str | None:
        """The step until the first text: leaves out the prompt text a stream primed with an
        unfinished character repeats, then hands over to the plain step (`_step` replaced)."""
        text = self._inner(token)
        if text and self._repeated:  # (a caller may hold this step for a few more tokens)
            text = text[self._repeated:]
            self._repeated = 0
            self._step = self._inner
        return text

    def _wrapped(self, step: Callable[[int], str | None]) -> Callable[[int], str | None]:
        return _AddedTokensJoined(step, self._added) if self._added else step

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append tokens; returns the stop string found in the new text, else None.
        `stop_terminated`: the last token ended the sequence as a stop token (eos or a stop
        token id), so its text is left out unless `include_stop_str_in_output`. Mutates the
        stream, `text`, `num_tokens` and `stopped`. O(new tokens) (plus the `str` append)."""
        if self.stopped:
            return None
        num_prev = self.num_tokens
        self.num_tokens = num_prev + len(new_token_ids)
        if stop_terminated and not self.include_stop:
            new_token_ids = new_token_ids[:-1]
        if not self.stop:
            self._decode(new_token_ids)
            return None
        # Stop strings count from where the token number min_tokens ends.
        boundary = self.min_tokens - num_prev
        if 0 < boundary <= len(new_token_ids):
            self._decode(new_token_ids[:boundary])
            check_from = len(self.text)
            self._decode(new_token_ids[boundary:])
        else:
            check_from = len(self.text)
            self._decode(new_token_ids)
        if self.num_tokens <= self.min_tokens:
            return None
        return self._cut_at_stop(check_from)

    def _decode(self, tokens: list[int]) -> None:
        """Step each token and append its text to `text` (mutated)."""
        step = self._step
        text = self.text
        for token in tokens:
            try:
                piece = step(token)
            except Exception as error:  # tokenizers raises a bare Exception
                piece = self._recover(token, error)
                step = self._step
            if piece:
                text += piece
        self.text = text

    def _recover(self, token: int, error: Exception) -> str | None:
        """What vLLM does when a step raises: an id the tokenizer cannot take gives no text; an
        invalid prefix restarts the stream without context (`_step` replaced) and steps the
        token again. Anything else is raised."""
        if isinstance(error, (OverflowError, TypeError)):
            return None
        if self._make_stream is None or not str(error).startswith(_INVALID_PREFIX):
            raise error
        self._step = self._wrapped(self._make_stream([], self._skip_special))
        return self._step(token)

    def _cut_at_stop(self, check_from: int) -> str | None:
        """Cut `text` at the stop string that ends first among those ending past `check_from`
        (ties: the first in `stop`); mutates `text` and `stopped`. Returns that string."""
        text = self.text
        best_at, best = -1, None
        for stop in self.stop:
            at = text.find(stop, max(0, check_from - len(stop) + 1))
            if at != -1 and (best is None or at + len(stop) < best_at + len(best)):
                best_at, best = at, stop
        if best is None:
            return None
        self.text = text[:best_at + len(best)] if self.include_stop else text[:best_at]
        self.stopped = True
        return best
