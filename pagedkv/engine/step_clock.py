"""When the engine core process's current step began, shared with its frontend.

The core writes the `time.monotonic()` of each step's start (0.0 while it has no work) into an
8-byte memory-mapped file in the client's private directory; the frontend reads it, so the
server's /health sees a core step that never returns (a wedged kernel) although the frontend's
own loop, which only waits for outputs, never blocks on it. CLOCK_MONOTONIC is one clock for
every process of a machine, so the two sides' readings compare.

The file's second field counts the messages the core has taken from the frontend: the
frontend compares it with what it sent, so work that a frozen idle core never took shows too.
"""

from __future__ import annotations

import mmap
import struct
import time

_FORMAT = "dq"  # the current step's start (0.0: idle), the number of messages taken
_SIZE = struct.calcsize(_FORMAT)
_TAKEN_OFFSET = struct.calcsize("d")


class StepClock:
    """One side's view of the shared clock file at `path` (`create=True`: make it, zeroed)."""

    def __init__(self, path: str, *, create: bool = False) -> None:
        if create:
            with open(path, "wb") as f:
                f.write(bytes(_SIZE))
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), _SIZE)

    def step_started(self, now: float | None = None) -> None:
        """Record that a step began (now). Mutates the shared file."""
        struct.pack_into("d", self._map, 0, time.monotonic() if now is None else now)

    def idle(self) -> None:
        """Record that the core has no work (no step runs). Mutates the shared file."""
        struct.pack_into("d", self._map, 0, 0.0)

    def taken(self, count: int) -> None:
        """Record that the core has taken `count` messages in all. Mutates the shared file."""
        struct.pack_into("q", self._map, _TAKEN_OFFSET, count)

    def num_taken(self) -> int:
        """How many messages the core has taken from the frontend."""
        return struct.unpack_from("q", self._map, _TAKEN_OFFSET)[0]

    def busy_for(self) -> float:
        """Seconds since the current step began; 0.0 while idle."""
        (started,) = struct.unpack_from("d", self._map, 0)
        return 0.0 if started <= 0.0 else max(0.0, time.monotonic() - started)

    def close(self) -> None:
        self._map.close()
