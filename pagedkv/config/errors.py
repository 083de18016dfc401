"""Errors every layer may raise and the engine's callers tell apart by type."""

from __future__ import annotations

from enum import StrEnum


class EngineFatalError(RuntimeError):
    """The engine cannot go on (e.g. a tensor-parallel rank died): unlike a failed step, which
    ends only its own requests, this ends the engine; callers stop it and report why."""


class ErrorKind(StrEnum):
    """Why the engine ended a request with an error (`CoreOutput.error_kind`, copied to
    `RequestOutput.error_kind`): the server answers 400 for INVALID, 500 for INTERNAL."""

    INVALID = "invalid"  # the request can never run (e.g. it can never fit the KV cache)
    INTERNAL = "internal"  # the model step it was in failed: the server's fault
