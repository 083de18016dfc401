"""Llama 3.x JSON tool calls: the output is `{"name": ..., "parameters": {...}}` (optionally
after `<|python_tag|>`), several separated by `;` (vLLM's `llama3_json` parser)."""

from __future__ import annotations

import json

from pagedkv.server.tool_parsers.base import ParsedToolCall, ToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        body = text.strip().removeprefix(PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return text, []
            call = ParsedToolCall.from_json(obj, arguments_key="parameters")
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return None, calls
