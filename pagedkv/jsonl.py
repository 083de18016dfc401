"""An append-only JSON-lines file shared by threads (the server's request log, the engine's
step log)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class JsonLinesWriter:
    """Appends one compact JSON object per line to `path` (created or appended to),
    line-buffered so a crash loses at most the line being written. Thread-safe; lines written
    after `close()` are dropped."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def write(self, row: dict[str, Any]) -> None:
        line = json.dumps(row, separators=(",", ":")) + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)

    def close(self) -> None:
        with self._lock:
            self._file.close()


def jsonl_rows(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line of a JSON-lines file. ValueError naming
    the file and line for a line that is not a JSON object."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON: {exc}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: not a JSON object")
            yield number, row


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every object of a JSON-lines file (`jsonl_rows`)."""
    return [row for _, row in jsonl_rows(path)]
