"""What every tool-call parser returns."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedToolCall:
    """One call: the function's name and its arguments as a JSON string (OpenAI's layout)."""

    name: str
    arguments: str

    @classmethod
    def from_json(cls, obj: Any, arguments_key: str = "arguments") -> ParsedToolCall | None:
        """From `{"name": ..., arguments_key: {...}}` (None when `obj` is not that shape)."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get(arguments_key, obj.get("arguments", {}))
        return cls(obj["name"], args if isinstance(args, str) else json.dumps(args))


class ToolParser:
    """Splits a finished model output into (content or None, tool calls)."""

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        raise NotImplementedError
