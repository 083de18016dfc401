"""Errors every layer may raise and the engine's callers tell apart by type."""

from __future__ import annotations


class EngineFatalError(RuntimeError):
    """The engine cannot go on (e.g. a tensor-parallel rank died): unlike a failed step, which
    ends only its own requests, this ends the engine; callers stop it and report why."""
