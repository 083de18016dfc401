"""Bounds on one structured-output constraint, so no client's constraint can stall the others.

A compile's cost grows with the constraint (a 50,000-way `choice` list compiled for 30 s), so the
size of each kind is bounded before anything is compiled, and a compile that still runs past
`compile_timeout_s` is answered with an error (the compile itself cannot be interrupted; it
finishes on its own thread and its result is cached). Each bound is an engine option with the
same name prefixed `structured_outputs_` (`--structured-outputs-max-choices`, ...).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields

from pagedkv.config.options import StructuredOptions
from pagedkv.structured.params import StructuredOutputsParams

# The engine options' defaults (declared in pagedkv.config.options).
_OPTIONS = StructuredOptions()
DEFAULT_MAX_CHOICES = _OPTIONS.structured_outputs_max_choices
DEFAULT_MAX_PATTERN_CHARS = _OPTIONS.structured_outputs_max_pattern_chars
DEFAULT_MAX_GRAMMAR_CHARS = _OPTIONS.structured_outputs_max_grammar_chars
DEFAULT_MAX_SCHEMA_CHARS = _OPTIONS.structured_outputs_max_schema_chars
DEFAULT_COMPILE_TIMEOUT_S = _OPTIONS.structured_outputs_compile_timeout_s
DEFAULT_COMPILE_THREADS = _OPTIONS.structured_outputs_compile_threads


class ConstraintTooLargeError(ValueError):
    """A constraint beyond one of the limits (HTTP 400, naming the limit)."""


class CompileTimeoutError(ValueError):
    """A constraint that did not compile within `compile_timeout_s`."""


@dataclass(frozen=True)
class StructuredOutputsLimits:
    """`max_choices`: alternatives of a `choice` list (their total characters count against
    `max_grammar_chars`); `max_pattern_chars`: characters of a `regex`; `max_grammar_chars`:
    characters of a `grammar`; `max_schema_chars`: characters of a `json` schema (as compact
    JSON); `compile_timeout_s`: how long one request waits for its compile;
    `compile_threads`: the compile pool's threads."""

    max_choices: int = DEFAULT_MAX_CHOICES
    max_pattern_chars: int = DEFAULT_MAX_PATTERN_CHARS
    max_grammar_chars: int = DEFAULT_MAX_GRAMMAR_CHARS
    max_schema_chars: int = DEFAULT_MAX_SCHEMA_CHARS
    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    compile_threads: int = DEFAULT_COMPILE_THREADS

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "compile_timeout_s":
                ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
                      and math.isfinite(value) and value > 0)
            else:
                ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
            if not ok:
                raise ValueError(f"structured_outputs_{f.name} must be positive, got {value!r}")

    def check(self, params: StructuredOutputsParams) -> None:
        """Raise ConstraintTooLargeError naming the limit `params` exceeds."""
        kind = params.kind
        if kind == "choice":
            self._bound("choice", "alternatives", len(params.choice), "max_choices")
            self._bound("choice", "characters", sum(len(c) for c in params.choice),
                        "max_grammar_chars")
        elif kind == "regex":
            self._bound("regex", "characters", len(params.regex), "max_pattern_chars")
        elif kind == "grammar":
            self._bound("grammar", "characters", len(params.grammar), "max_grammar_chars")
        elif kind == "json":
            schema = params.json
            size = len(schema) if isinstance(schema, str) else len(
                json.dumps(schema, separators=(",", ":")))
            self._bound("json", "characters", size, "max_schema_chars")

    def _bound(self, kind: str, what: str, value: int, limit: str) -> None:
        bound = getattr(self, limit)
        if value > bound:
            flag = "--structured-outputs-" + limit.replace("_", "-")
            raise ConstraintTooLargeError(
                f"structured_outputs.{kind} has {value} {what}, more than the limit of "
                f"{bound} (structured_outputs_{limit}, {flag})")
