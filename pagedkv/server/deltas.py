"""Streaming deltas and logprobs: what is new in a cumulative `CompletionOutput`, and how to
write its log-probabilities in OpenAI's two formats (completions' parallel lists, chat's list
of token objects).

While a choice runs, the last `max(len(stop)) - 1` characters of its text are held back: they
could be the start of a stop string that the engine will cut off, and text once sent cannot be
taken back. The held-back text goes out with the next delta or the final one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.engine.outputs import CompletionOutput
from pagedkv.http.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)
from pagedkv.server.token_text import MAX_CONTEXT, corrected_token_text


@dataclass(slots=True)
class Delta:
    """New text and the range of new tokens of one choice since the last delta."""

    text: str
    token_start: int
    token_end: int
    finish_reason: str | None
    stop_reason: int | str | None


class DeltaTracker:
    """Remembers, per choice index, how much text and how many tokens were already sent."""

    def __init__(self, num_choices: int, stop: list[str], include_stop_str: bool) -> None:
        self._text_sent = [0] * num_choices
        self._tokens_sent = [0] * num_choices
        self._finished = [False] * num_choices
        longest = max((len(s) for s in stop), default=0)
        self._holdback = 0 if include_stop_str else max(longest - 1, 0)

    def delta(self, index: int, comp: CompletionOutput) -> Delta | None:
        """What choice `index` gained since the last call (None when nothing, or when its
        finish was already sent). Mutates the tracker: the returned delta counts as sent."""
        if self._finished[index]:
            return None
        finished = comp.finish_reason is not None
        sent = self._text_sent[index]
        end = len(comp.text) if finished else len(comp.text) - self._holdback
        text = comp.text[sent:end] if end > sent else ""
        token_start, token_end = self._tokens_sent[index], comp.num_tokens
        if not text and token_end == token_start and not finished:
            return None
        self._text_sent[index] = max(sent, end)
        self._tokens_sent[index] = token_end
        self._finished[index] = finished
        return Delta(text, token_start, token_end, comp.finish_reason, comp.stop_reason)

    @property
    def all_finished(self) -> bool:
        return all(self._finished)


FLOOR = -9999.0  # what OpenAI reports for an impossible token; JSON has no -inf


def finite(logprob: float | None) -> float:
    """`logprob` clamped to FLOOR (-inf, NaN and None become FLOOR)."""
    if logprob is None or logprob != logprob or logprob < FLOOR:
        return FLOOR
    return float(logprob)


class LogprobsFormatter:
    """Turns `CompletionOutput.logprobs` (per token: token id -> logprob, top-N plus the sampled
    one) into OpenAI's formats. `top_n` is how many alternatives the client asked for;
    `as_token_ids` writes tokens as 'token_id:<id>' (vLLM's `return_tokens_as_token_ids`)."""

    def __init__(self, tokenizer: Any, top_n: int, *, as_token_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.top_n = top_n
        self.as_token_ids = as_token_ids
        self._cache: dict[int, str] = {}
        self._offsets: dict[int, int] = {}  # choice index -> text offset of its next token

    def decoded(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text

    def token_text(self, token_id: int, context: Sequence[int] = ()) -> str:
        """The token as text, or 'token_id:<id>' when `as_token_ids` (exact, for tests). A
        token that is part of a multi-byte character is written as vLLM writes it, after
        `context` (the preceding tokens): "" while unfinished, the character once complete."""
        if self.as_token_ids:
            return f"token_id:{token_id}"
        text = self.decoded(token_id)
        if text.endswith("\ufffd"):
            return corrected_token_text(self._decode_ids, token_id, context)
        return text

    def _decode_ids(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _entry(self, token_id: int, table: dict[int, float]):
        """(token id, its logprob, top-N [(id, logprob)]) of one token's logprobs table."""
        top = sorted(table.items(), key=lambda kv: -kv[1])[: self.top_n]
        logprob = table.get(token_id)
        return token_id, None if logprob is None else finite(logprob), [
            (t, finite(lp)) for t, lp in top]

    def _entries(self, comp: CompletionOutput, start: int, end: int):
        """`_entry` of tokens start..end-1, each with its context (the tokens before it)."""
        logprobs = comp.logprobs_view or []
        ids = comp.token_ids_view  # (no copy: a stream reads a few new tokens per step)
        for pos in range(start, min(end, len(logprobs), len(ids))):
            context = ids[max(0, pos - MAX_CONTEXT):pos]
            yield (*self._entry(ids[pos], logprobs[pos]), context)

    def completion(self, comp: CompletionOutput, start: int, end: int,
                   choice: int = 0) -> CompletionLogprobs | None:
        """Completions-format logprobs of tokens start..end-1 of choice `choice`; text offsets
        carry on from the previous call for the same choice (call in token order)."""
        if comp.logprobs_view is None:
            return None
        out = CompletionLogprobs()
        for token_id, logprob, top, context in self._entries(comp, start, end):
            self._append(out, choice, token_id, logprob, top, context)
        return out

    def echoed_prompt(self, prompt_ids: list[int],
                      prompt_logprobs: list[dict[int, float] | None] | None,
                      choice: int = 0) -> CompletionLogprobs:
        """Completions-format logprobs of an echoed prompt (call before the choice's output
        tokens): the first token's logprob and alternatives are null, as in OpenAI's API."""
        out = CompletionLogprobs()
        tables = prompt_logprobs or [None] * len(prompt_ids)
        for pos, (token_id, table) in enumerate(zip(prompt_ids, tables, strict=True)):
            context = _prompt_context(prompt_ids, pos)
            if table is None:
                self._append(out, choice, token_id, None, None, context)
            else:
                self._append(out, choice, *self._entry(token_id, table), context)
        return out

    def _append(self, out: CompletionLogprobs, choice: int, token_id: int,
                logprob: float | None, top: list[tuple[int, float]] | None,
                context: Sequence[int] = ()) -> None:
        """Add one token to `out`, at choice `choice`'s running text offset (advanced)."""
        token = self.token_text(token_id, context)
        out.tokens.append(token)
        out.token_logprobs.append(logprob)
        if top is None:
            out.top_logprobs.append(None)
        else:
            table = {self.token_text(t, context): lp for t, lp in top}
            if logprob is not None:
                table.setdefault(token, logprob)
            out.top_logprobs.append(table)
        text_offset = self._offsets.get(choice, 0)
        out.text_offset.append(text_offset)
        self._offsets[choice] = text_offset + len(self.decoded(token_id))

    def vllm_prompt_logprobs(self, prompt_logprobs: list[dict[int, float] | None] | None,
                             prompt_ids: Sequence[int] = ()) -> PromptLogprobs | None:
        """vLLM's `prompt_logprobs` response field: per prompt token, token id -> logprob
        (`prompt_ids` give the context of split characters' tokens)."""
        if prompt_logprobs is None:
            return None
        return [None if table is None else {
            str(t): PromptLogprob(logprob=finite(lp), decoded_token=self.token_text(
                t, _prompt_context(prompt_ids, pos)))
            for t, lp in table.items()} for pos, table in enumerate(prompt_logprobs)]

    def chat(self, comp: CompletionOutput, start: int, end: int) -> ChatLogprobs | None:
        """Chat-format logprobs of tokens start..end-1."""
        if comp.logprobs_view is None:
            return None
        content = []
        for token_id, logprob, top, context in self._entries(comp, start, end):
            token = self.token_text(token_id, context)
            tops = [(self.token_text(t, context), lp) for t, lp in top]
            content.append(ChatTokenLogprob(
                token=token, logprob=finite(logprob),
                bytes=list(token.encode("utf-8")),
                top_logprobs=[TopLogprob(token=text, logprob=lp, bytes=list(text.encode("utf-8")))
                              for text, lp in tops]))
        return ChatLogprobs(content=content)


def _prompt_context(prompt_ids: Sequence[int], pos: int) -> list[int]:
    """The context vLLM gives prompt token `pos`: the prompt tokens before it that have
    logprobs (all but the first), at most MAX_CONTEXT."""
    return list(prompt_ids[max(1, pos - MAX_CONTEXT):pos])
