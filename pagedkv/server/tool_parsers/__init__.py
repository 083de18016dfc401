"""Tool-call parsers for `tool_choice: "auto"`: each turns a model's raw text into content plus
tool calls, in one model family's format. Chosen with `pagedkv serve --tool-call-parser NAME`
(vLLM's names). A new format is a new module here plus one line in `TOOL_PARSERS`."""

from __future__ import annotations

from pagedkv.server.tool_parsers.base import ParsedToolCall, ToolParser
from pagedkv.server.tool_parsers.hermes import HermesToolParser
from pagedkv.server.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as `name`; ValueError naming the choices otherwise."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of "
                         f"{sorted(TOOL_PARSERS)}")
    return cls()


__all__ = ["TOOL_PARSERS", "ParsedToolCall", "ToolParser", "get_tool_parser"]
