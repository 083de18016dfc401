"""OpenAI's Responses API (POST /v1/responses), the text subset: request and response models.

A request's `input` is a string (one user message) or a list of messages (`role` user, system,
developer or assistant; `content` a string or `input_text` / `output_text` parts), with
`instructions` as a leading system message; it becomes a chat request (the model's chat
template). `max_output_tokens`, `temperature`, `top_p`, `user`, `metadata`, `store`
(nothing is stored: always false in the answer), `parallel_tool_calls`, `truncation`
("disabled", or "auto": the input's start is dropped to fit the context), `text` (`format:
{"type": "text"}`, `verbosity`) and `prompt_cache_key`, `prompt_cache_retention`,
`safety_identifier` (echoed in the answer) are accepted; `tools`, `background`, and any format
other than text are a 400 (not implemented), and a `previous_response_id` a 404 (no response is
stored: vLLM's answer for an unknown id). Unknown fields are
ignored with a warning, as on the other routes.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedkv.http.protocol import INT64_MAX, ChatCompletionRequest, ChatMessage, _Request
from pagedkv.http.request_fields import IgnoresUnknownFields


class InputTextPart(_Request):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None


class InputMessage(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputTextPart]
    id: str | None = None
    status: str | None = None


class TextFormat(_Request):
    type: Literal["text"]


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Request, IgnoresUnknownFields):
    model: str | None = None
    input: str | Annotated[list[InputMessage], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["disabled", "auto"] | None = None
    text: TextConfig | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=0)] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    previous_response_id: str | None = None  # nothing is stored: always a 404, as vLLM's
    background: Literal[False] | None = None
    seed: int | None = None
    # OpenAI's prompt-cache routing hints and abuse-tracking id: echoed, nothing else (a router
    # in front places prompts by their blocks; nothing is retained beyond the request).
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = None

    def to_chat(self) -> ChatCompletionRequest:
        """The same request as a chat completion (instructions first, as a system message)."""
        messages = [] if self.instructions is None else [
            ChatMessage(role="system", content=self.instructions)]
        if isinstance(self.input, str):
            messages.append(ChatMessage(role="user", content=self.input))
        else:
            for item in self.input:
                text = item.content if isinstance(item.content, str) else "".join(
                    part.text for part in item.content)
                messages.append(ChatMessage(role=item.role, content=text))
        return ChatCompletionRequest(
            model=self.model, messages=messages, max_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, seed=self.seed, user=self.user)


def _now() -> int:
    return int(time.time())


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]
    phase: None = None  # OpenAI's commentary / final-answer label (no such phases here)


class InputTokensDetails(BaseModel):
    """OpenAI's `cached_tokens`; vLLM 0.32's `cache_write_tokens` and per-turn lists (one turn
    here: vLLM leaves the lists empty outside its multi-turn tool loop)."""

    cached_tokens: int = 0
    cache_write_tokens: int = 0
    input_tokens_per_turn: list[int] = Field(default_factory=list)
    cached_tokens_per_turn: list[int] = Field(default_factory=list)


class OutputTokensDetails(BaseModel):
    """As InputTokensDetails: no reasoning parser, no built-in tools, one turn."""

    reasoning_tokens: int = 0
    tool_output_tokens: int = 0
    output_tokens_per_turn: list[int] = Field(default_factory=list)
    tool_output_tokens_per_turn: list[int] = Field(default_factory=list)


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=_now)
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputMessage] = Field(default_factory=list)
    parallel_tool_calls: bool = False
    previous_response_id: None = None
    store: bool = False
    temperature: float
    top_p: float
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"},
                                                          "verbosity": "medium"})
    tool_choice: str = "none"
    tools: list[Any] = Field(default_factory=list)
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    system_fingerprint: str | None = None
    completed_at: int | None = None  # set when status is "completed", as OpenAI's
    conversation: None = None  # no stored conversations
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # OpenAI's and vLLM 0.32's further keys, with what this server does: never in the
    # background, no tool-call cap, no stored prompt template or reasoning config, one service
    # tier, no penalties or logprobs on this route, no KV/encoder-cache transfer, and none of
    # vLLM's harmony message records.
    background: bool = False
    max_tool_calls: None = None
    prompt: None = None
    reasoning: None = None
    service_tier: Literal["auto"] = "auto"
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: None = None
    kv_transfer_params: None = None
    ec_transfer_params: None = None
    input_messages: None = None
    output_messages: None = None
