"""Grammar-engine error messages a client may read: no build paths, no C++ check names."""

from __future__ import annotations

import re

# xgrammar prefixes its messages with "[hh:mm:ss] /build/path/file.cc:123: " and sometimes
# "Check failed: (cond) is false: "; a traceback's file lines carry the same paths.
_LOCATION = re.compile(r"\[\d\d:\d\d:\d\d\]\s*|(?:[\w.~-]*/)+[\w.-]+\.(?:cc|cpp|h|hpp|py):\d+:\s*")
_CHECK = re.compile(r"Check failed:\s*\(.*?\)\s*is false:\s*")


def clean_grammar_error(exc: BaseException | str, limit: int = 300) -> str:
    """`exc`'s message without source locations or check expressions, on one line, at most
    `limit` characters."""
    text = str(exc)
    text = _LOCATION.sub("", text)
    text = _CHECK.sub("", text)
    text = " ".join(text.split())
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    if not text and isinstance(exc, BaseException):
        return type(exc).__name__
    return text
