"""Options given as a JSON object: on the command line a JSON string, in Python a dict
(`kv_events_config`, `kv_transfer_config`, `speculative_config`)."""

from __future__ import annotations

import json
from typing import Any


def json_object(name: str, value: str | dict) -> dict[str, Any]:
    """`value` as a dict: a JSON string parsed, a dict as it is. ValueError naming `name` when
    the string is not JSON or not an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {value!r} ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object or dict, got {value!r}")
    return value
