"""A streamed answer's usual chunk written from a template: the same bytes as the chunk model's
SSE event, in a fraction of the time.

Most chunks of a stream differ from one another only in a few values (the text, the choice
index, the `created` second). A `ChunkTemplate` renders the chunk once, through the same
function every chunk would go through, with a unique placeholder in each varying place; each
chunk then joins the fixed parts with the values (a string as `json.dumps` writes it, an int
as `str`), which is what that function writes for them. When a placeholder cannot be found
exactly once in the rendering (a response id or model name that happens to contain it), there
is no template and the caller renders every chunk itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

# Values no real chunk holds (an int past any second or index; text with a code point JSON
# escapes), each found in the rendering by its JSON.
INT_PLACEHOLDER = 8_355_201_467_901_113
TEXT_PLACEHOLDER = "\u2063pagedkv-chunk-text\u2063"


class ChunkTemplate:
    """`event(*values)`: `render(placeholders)` with the values in the placeholders' places.

    `holes` names each varying value's kind in order ("int" or "str"); `render` gets one
    placeholder per hole (distinct ints for "int" holes, distinct strings for "str" holes) and
    returns the chunk's SSE event."""

    __slots__ = ("_parts", "_order")

    def __init__(self, parts: list[str], order: list[int]) -> None:
        self._parts = parts  # the fixed text around the holes: len(order) + 1 pieces
        self._order = order  # which hole comes next in the rendering

    @classmethod
    def make(cls, render: Callable[[list[Any]], str], holes: list[str]) -> ChunkTemplate | None:
        """The template of `render`'s chunks (None when a placeholder is not found exactly
        once in the rendering)."""
        placeholders: list[Any] = [
            INT_PLACEHOLDER + i if kind == "int" else f"{TEXT_PLACEHOLDER}{i}"
            for i, kind in enumerate(holes)]
        rendered = render(placeholders)
        found = []
        for i, value in enumerate(placeholders):
            needle = str(value) if holes[i] == "int" else json.dumps(value)
            if rendered.count(needle) != 1:
                return None
            found.append((rendered.index(needle), len(needle), i))
        found.sort()
        parts, order, start = [], [], 0
        for position, length, i in found:
            parts.append(rendered[start:position])
            order.append(i)
            start = position + length
        parts.append(rendered[start:])
        return cls(parts, order)

    def event(self, *values: int | str) -> str:
        """The chunk with `values` (one per hole, in the holes' order given to `make`)."""
        parts = self._parts
        pieces = [parts[0]]
        for k, i in enumerate(self._order):
            value = values[i]
            pieces.append(json.dumps(value) if type(value) is str else str(int(value)))
            pieces.append(parts[k + 1])
        return "".join(pieces)
