"""RequestOutput and CompletionOutput: what `LLM.generate` and `LLMEngine.step` return (vLLM's shapes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedkv.config.errors import ErrorKind


@dataclass
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

    index: int
    text: str = ""
    token_ids: Sequence[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: Sequence[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

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


def _get_token_ids(self: CompletionOutput) -> list[int]:
    ids = self._token_ids
    if type(ids) is not list:  # a view: copied into a list on the first read
        ids = self._token_ids = list(ids)
    return ids


def _set_token_ids(self: CompletionOutput, value: Sequence[int]) -> None:
    self._token_ids = value


def _get_logprobs(self: CompletionOutput) -> list[dict[int, float]] | None:
    lps = self._logprobs
    if lps is not None and type(lps) is not list:
        lps = self._logprobs = list(lps)
    return lps


def _set_logprobs(self: CompletionOutput, value: Sequence[dict[int, float]] | None) -> None:
    self._logprobs = value


# Set after @dataclass built the class (its __init__, __eq__, __repr__, `replace` and `asdict`
# go through them), so the two fields read as lists while the engine hands out views.
CompletionOutput.token_ids = property(  # type: ignore[assignment]
    _get_token_ids, _set_token_ids, doc="The output token ids (a list).")
CompletionOutput.logprobs = property(  # type: ignore[assignment]
    _get_logprobs, _set_logprobs, doc="Per output token, its logprobs table (None unless asked).")


@dataclass(slots=True)
class RequestOutput:
    """A request's output so far (cumulative). `num_cached_tokens` counts prompt tokens served
    from the prefix cache. `error` explains a `finish_reason == "error"` (e.g. can never fit),
    and `error_kind` says whose fault it was (`ErrorKind.INVALID`: the request's; INTERNAL: a
    failed model step's).
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
    error_kind: ErrorKind | None = None
