"""What the event loop asks of `AsyncEngine`'s loop thread: one dataclass per command, queued
in order and applied by the loop thread between steps (`AsyncEngine._drain_commands`).

A command that awaits an answer carries the event loop's `future`, which the loop thread
resolves (`Answered`); a caller that gave up cancels it, and the loop thread then skips it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from pagedkv.engine.input_processor import PromptType
from pagedkv.engine.request_stream import RequestStream
from pagedkv.sched.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Stop:
    """End the loop (after aborting what is left)."""


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Add the stream's request; `future` resolves (None, or the ValueError) once added."""

    stream: RequestStream
    prompt: PromptType
    params: SamplingParams
    priority: int
    cache_salt: str | None
    future: asyncio.Future


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Abort a request by id (unknown ids are ignored)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class FailAll:
    """End every request in flight with EngineDeadError(reason)."""

    reason: str


@dataclass(frozen=True, slots=True)
class StartUtility:
    """Start the core's utility call `method(*args)`; `future` resolves with its answer."""

    method: str
    args: tuple[Any, ...]
    future: asyncio.Future


@dataclass(frozen=True, slots=True)
class Pin:
    """Pin the prompt's prefix, first asking the core whether it is cached (`PinChecked`)."""

    prompt: PromptType
    cache_salt: str | None
    future: asyncio.Future


@dataclass(frozen=True, slots=True)
class PinChecked:
    """The core answered whether `ids` are cached (`check`): pin now, or run them first."""

    ids: list[int]
    cache_salt: str | None
    future: asyncio.Future
    check: Future


@dataclass(frozen=True, slots=True)
class Unpin:
    """Release the prompt's pin; `future` resolves with the PinInfo after."""

    prompt: PromptType
    cache_salt: str | None
    future: asyncio.Future


Answered = AddRequest | StartUtility | Pin | PinChecked | Unpin
Command = Stop | AbortRequest | FailAll | Answered
