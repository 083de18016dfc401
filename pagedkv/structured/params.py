"""StructuredOutputsParams: the constraint one request's output must satisfy (vLLM's fields)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: `json` (a JSON schema, as a dict or a JSON string), `regex`, `choice`
    (the output is one of these strings), `grammar` (EBNF / GBNF with a `root` rule, or Lark),
    `json_object=True` (any JSON object). Raises ValueError naming the problem otherwise.

    `key` identifies the constraint (the compile cache's key): equal constraints share it.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, "
                             f"grammar or json_object, got {given or 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    json.loads(self.json)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from exc
            elif not isinstance(self.json, dict):
                raise ValueError(f"structured_outputs.json must be a JSON schema (object or "
                                 f"string), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, "
                                 f"got {value!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 f"non-empty strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be a boolean, "
                             f"got {self.json_object!r}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        value = getattr(self, self.kind)
        if self.kind == "json":
            value = json.loads(value) if isinstance(value, str) else value
            return ("json", json.dumps(value, sort_keys=True))
        if self.kind == "choice":
            return ("choice", json.dumps(list(value)))
        return (self.kind, str(value))
