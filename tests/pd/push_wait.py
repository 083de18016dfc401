"""A bounded wait for the push transport's tests (a receiver thread works in the background)."""

from __future__ import annotations

import time
from collections.abc import Callable

WAIT_S = 5.0


def wait_for(predicate: Callable[[], bool], timeout_s: float = WAIT_S) -> bool:
    """True as soon as `predicate()` is, False once `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return False
