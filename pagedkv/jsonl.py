"""An append-only JSON-lines file shared by threads (the server's request log, the engine's
step log)."""

from __future__ import annotations

import json
import threading
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
