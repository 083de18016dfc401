"""A streamed answer's usual chunk written from a template: the same bytes as the chunk model's
SSE event, in a fraction of the time.

Most chunks of a stream differ from one another only in three values: the `created` second, the
choice's index and its text. A `ChunkTemplate` renders the chunk once, through the same function
every chunk would go through, with a unique placeholder in each of those places; each chunk then
puts the values into the fixed text around them, written as that function writes them (an int
as `str`, the text as `json.dumps` writes a string). When a placeholder is not found exactly
once in the rendering (a response id or model name that happens to contain it), there is no
template and the caller renders every chunk itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from json.encoder import encode_basestring_ascii  # what json.dumps writes a str with

# Values no real chunk holds (ints past any second or index; text with a code point JSON
# escapes), each looked for in the rendering as it is written there.
INT_PLACEHOLDER = 8_355_201_467_901_113
TEXT_PLACEHOLDER = "\u2063pagedkv-chunk-text\u2063"


class ChunkTemplate:
    """`event(created, index, text)`: `render(created, index, text)`'s chunk, made without
    calling `render` (see the module docstring)."""

    __slots__ = ("_format",)

    def __init__(self, format_string: str) -> None:
        self._format = format_string  # the rendering, holes as {0} {1} {2}, braces doubled

    @classmethod
    def make(cls, render: Callable[[int, int, str], str]) -> ChunkTemplate | None:
        """The template of `render`'s chunks (None when a placeholder is not found exactly
        once in the rendering)."""
        created, index = INT_PLACEHOLDER, INT_PLACEHOLDER + 1
        rendered = render(created, index, TEXT_PLACEHOLDER)
        holes = []
        for field, needle in enumerate((str(created), str(index), json.dumps(TEXT_PLACEHOLDER))):
            if rendered.count(needle) != 1:
                return None
            holes.append((rendered.index(needle), len(needle), field))
        pieces, start = [], 0
        for position, length, field in sorted(holes):
            pieces.append(_escaped(rendered[start:position]) + "{" + str(field) + "}")
            start = position + length
        pieces.append(_escaped(rendered[start:]))
        return cls("".join(pieces))

    def event(self, created: int, index: int, text: str) -> str:
        """The chunk with these values."""
        return self._format.format(created, index, encode_basestring_ascii(text))


def _escaped(fixed: str) -> str:
    """`fixed` as literal text of a format string."""
    return fixed.replace("{", "{{").replace("}", "}}")
