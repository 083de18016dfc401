"""Hermes / Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
any number of them, after optional free text (vLLM's `hermes` parser)."""

from __future__ import annotations

import json
import re

from pagedkv.server.tool_parsers.base import ParsedToolCall, ToolParser

# A call may be left unclosed when the output ran out of tokens right after its JSON.
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    START = "<tool_call>"

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        if self.START not in text:
            return text, []
        calls = []
        for body in _CALL.findall(text):
            try:
                call = ParsedToolCall.from_json(json.loads(body))
            except ValueError:
                call = None
            if call is None:  # not a well-formed call: the whole text is content
                return text, []
            calls.append(call)
        content = text[:text.index(self.START)].strip()
        return content or None, calls
