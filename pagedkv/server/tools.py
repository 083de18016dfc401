"""Tool calling on /v1/chat/completions, with vLLM's semantics.

`tool_choice`:
- `none` (or no tools): plain content; the template still sees the tools.
- `auto` (the default when tools are given): the model decides; its text is split into content
  and calls by the server's `--tool-call-parser` (without one, `auto` is a 400, as in vLLM).
- `required`: structured outputs force a JSON array of `{"name", "parameters"}` objects, one
  of the tools each (at most one when `parallel_tool_calls` is false).
- a named function: structured outputs force that function's parameters schema; the whole
  output is its arguments.
Calls come back as `message.tool_calls` with JSON-string `arguments`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pagedkv.http.errors import APIError
from pagedkv.http.protocol import (
    ChatCompletionRequest,
    ChatResponseMessage,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
)
from pagedkv.server.tool_parsers import ParsedToolCall, ToolParser
from pagedkv.structured.params import StructuredOutputsParams

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _parameters(function: Any) -> dict[str, Any]:
    return function.parameters if function.parameters is not None else EMPTY_PARAMETERS


@dataclass
class ToolChoice:
    """How one chat request uses its tools (see the module docstring)."""

    mode: str  # "none", "auto", "required" or "named"
    template_tools: list[dict[str, Any]] | None = None
    parser: ToolParser | None = None
    function_name: str | None = None
    constraint: StructuredOutputsParams | None = None

    @classmethod
    def of(cls, req: ChatCompletionRequest, parser: ToolParser | None) -> ToolChoice:
        """Validate the request's tools and tool_choice (APIError 400, as vLLM answers)."""
        choice = req.tool_choice
        if not req.tools:
            if choice is not None and choice != "none":
                raise APIError("when tool_choice is set, tools must be set too",
                               param="tool_choice")
            return cls("none")
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        if choice == "none":
            return cls("none", tools)
        if choice is None or choice == "auto":
            if parser is None:
                raise APIError('"auto" tool choice requires the server to be started with '
                               "--tool-call-parser", param="tool_choice")
            return cls("auto", tools, parser)
        if choice == "required":
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
                {"type": "object",
                 "properties": {"name": {"const": t.function.name},
                                "parameters": _parameters(t.function)},
                 "required": ["name", "parameters"]} for t in req.tools]}}
            if req.parallel_tool_calls is False:
                schema["maxItems"] = 1
            return cls("required", tools, constraint=StructuredOutputsParams(json=schema))
        if not isinstance(choice, NamedToolChoice):  # the protocol admits nothing else
            raise APIError(f"unsupported tool_choice {choice!r}", param="tool_choice")
        name = choice.function.name
        function = next((t.function for t in req.tools if t.function.name == name), None)
        if function is None:
            raise APIError(f"tool_choice names function {name!r}, which is not in tools",
                           param="tool_choice")
        return cls("named", tools, function_name=name,
                   constraint=StructuredOutputsParams(json=_parameters(function)))

    @property
    def buffers_stream(self) -> bool:
        """Whether streamed text must be held until the end to be parsed into calls."""
        return self.mode in ("auto", "required")

    def calls(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, calls) of a finished output."""
        if self.mode == "named":
            return None, [ParsedToolCall(self.function_name or "", text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:  # cut short by max_tokens
                return text, []
            parsed = [ParsedToolCall.from_json(item, arguments_key="parameters")
                      for item in items if isinstance(items, list)]
            return None, [c for c in parsed if c is not None]
        if self.mode == "auto" and self.parser is not None:
            return self.parser.extract(text)
        return text, []

    def message(self, text: str) -> ChatResponseMessage:
        content, calls = self.calls(text)
        return ChatResponseMessage(content=content, tool_calls=[
            ToolCall(id=tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls])

    def finish_reason(self, reason: str | None, message: ChatResponseMessage) -> str | None:
        """OpenAI's `tool_calls` when the model stopped after calling tools by its choice or
        by `required`; a named function keeps `stop`, as in OpenAI's API."""
        if reason == "stop" and message.tool_calls and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason
