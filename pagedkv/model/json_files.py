"""`read_json`: a model directory's JSON files (config.json, tokenizer_config.json, ...), read
with errors that name the file. Torch-free, so the tokenizer (and the router) can use it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; a ValueError naming the file when it is missing or malformed."""
    if not path.is_file():
        raise ValueError(f"missing file: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed JSON in {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data
