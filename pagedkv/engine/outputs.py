"""RequestOutput and CompletionOutput: what `LLM.generate` and `LLMEngine.step` return (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """One sampled sequence of a request. `text` and `token_ids` are cumulative.

    `logprobs` (when asked for) holds, per output token, a dict token id -> log-probability with
    the top-N tokens and the sampled one. `finish_reason` is None while running, else "stop",
    "length", "abort" or "error"; `stop_reason` is the stop string or token id that ended it.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


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
