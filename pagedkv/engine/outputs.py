"""RequestOutput and CompletionOutput: what `LLM.generate` and `LLMEngine.step` return (vLLM's shapes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class CompletionOutput:
    """One sampled sequence of a request. `text` and `token_ids` are cumulative.

    `logprobs` (when asked for) holds, per output token, a dict token id -> log-probability with
    the top-N tokens and the sampled one. `finish_reason` is None while running, else "stop",
    "length", "abort" or "error"; `stop_reason` is the stop string or token id that ended it.

    The engine's step outputs hold `token_ids` and `logprobs` as views of lists it goes on
    appending to (O(1) per step, pagedkv/engine/prefix_view.py); reading either attribute
    makes it a list once (O(tokens)); `num_tokens`, `token_ids_view` and `logprobs_view` read
    them without a copy (the server's per-step path).
    """

    __slots__ = ("index", "text", "_token_ids", "cumulative_logprob", "_logprobs",
                 "finish_reason", "stop_reason")

    def __init__(self, index: int, text: str = "", token_ids: Sequence[int] | None = None,
                 cumulative_logprob: float | None = None,
                 logprobs: Sequence[dict[int, float]] | None = None,
                 finish_reason: str | None = None, stop_reason: int | str | None = None) -> None:
        self.index = index
        self.text = text
        self._token_ids: Sequence[int] = [] if token_ids is None else token_ids
        self.cumulative_logprob = cumulative_logprob
        self._logprobs = logprobs
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason

    @property
    def token_ids(self) -> list[int]:
        """The output token ids (a list: a view is copied into one on the first read)."""
        ids = self._token_ids
        if type(ids) is not list:
            ids = self._token_ids = list(ids)
        return ids

    @token_ids.setter
    def token_ids(self, value: Sequence[int]) -> None:
        self._token_ids = value

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        """Per output token, its logprobs table (None unless asked for; a list as `token_ids`)."""
        lps = self._logprobs
        if lps is not None and type(lps) is not list:
            lps = self._logprobs = list(lps)
        return lps

    @logprobs.setter
    def logprobs(self, value: Sequence[dict[int, float]] | None) -> None:
        self._logprobs = value

    @property
    def num_tokens(self) -> int:
        """len(token_ids), without a copy."""
        return len(self._token_ids)

    @property
    def token_ids_view(self) -> Sequence[int]:
        """`token_ids` as it is held (read-only; no copy)."""
        return self._token_ids

    @property
    def logprobs_view(self) -> Sequence[dict[int, float]] | None:
        """`logprobs` as they are held (read-only; no copy)."""
        return self._logprobs

    def finished(self) -> bool:
        return self.finish_reason is not None

    def replace(self, **changes: Any) -> CompletionOutput:
        """A copy with `changes` (keyword arguments of the constructor) applied."""
        fields = {"index": self.index, "text": self.text, "token_ids": self._token_ids,
                  "cumulative_logprob": self.cumulative_logprob, "logprobs": self._logprobs,
                  "finish_reason": self.finish_reason, "stop_reason": self.stop_reason}
        return CompletionOutput(**{**fields, **changes})

    def _key(self) -> tuple:
        return (self.index, self.text, self.token_ids, self.cumulative_logprob, self.logprobs,
                self.finish_reason, self.stop_reason)

    def __eq__(self, other: object) -> bool:
        if type(other) is not CompletionOutput:
            return NotImplemented
        return self._key() == other._key()

    __hash__ = None  # type: ignore[assignment] - mutable, as the dataclass it replaces

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index!r}, text={self.text!r}, "
                f"token_ids={self.token_ids!r}, cumulative_logprob={self.cumulative_logprob!r}, "
                f"logprobs={self.logprobs!r}, finish_reason={self.finish_reason!r}, "
                f"stop_reason={self.stop_reason!r})")


@dataclass(slots=True)
class RequestOutput:
    """A request's output so far (cumulative). `num_cached_tokens` counts prompt tokens served
    from the prefix cache. `error` explains a `finish_reason == "error"` (e.g. can never fit).
    `prompt_logprobs` (when asked for) has one entry per prompt token: None for the first, then
    token id -> log-probability (the top-N and the prompt's own token)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: dict[str, float] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
