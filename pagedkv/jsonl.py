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


def numbered_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(line number, text) for every line of a UTF-8 text file; ValueError naming the file
    and line for a line that is not UTF-8 (binary junk)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{number}: not UTF-8 text ({exc.reason} at byte "
                                 f"{exc.start})") from None


def parse_json_line(path: str | Path, number: int, line: str) -> Any:
    """One line's JSON value; ValueError naming the file and line when it is not JSON or is
    nested too deeply to parse."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{number}: not JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{path}:{number}: JSON nested too deeply") from None


def jsonl_rows(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line of a JSON-lines file. ValueError naming
    the file and line for a line that is not UTF-8, not JSON or not a JSON object."""
    for number, line in numbered_lines(path):
        if not line.strip():
            continue
        row = parse_json_line(path, number, line)
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: not a JSON object")
        yield number, row


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every object of a JSON-lines file (`jsonl_rows`)."""
    return [row for _, row in jsonl_rows(path)]
