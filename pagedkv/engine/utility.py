"""The engine core's utility calls: what a frontend may ask the core between its steps, the
same in both core clients (in-process and core process).

A name is an `EngineCore` method ("get_stats") or a dotted path to a method of one of its parts
("dashboard.drain": `EngineCore.dashboard`, pagedkv/engine/dashboard_calls.py). Arguments and
results must be msgpack-able (ints, floats, strings, lists, dicts, msgspec structs): across
processes they travel encoded.
"""

from __future__ import annotations

from typing import Any

# Every utility call a frontend may make (anything else is a ValueError).
UTILITY_METHODS = frozenset({
    "get_stats", "check_invariants", "is_prefix_cached", "pin_prefix", "unpin_prefix", "now",
    "dashboard.subscribe", "dashboard.unsubscribe", "dashboard.drain", "dashboard.block_table",
    "dashboard.explain", "dashboard.explain_recent",
})


def run_utility(core: Any, method: str, args: list[Any] | tuple[Any, ...]) -> Any:
    """Call `core.<method>(*args)` and return its result; whatever the method mutates, this
    mutates. ValueError naming `method` when it is not a utility call."""
    if method not in UTILITY_METHODS:
        raise ValueError(f"unknown utility method {method!r}")
    target = core
    for part in method.split("."):
        target = getattr(target, part)
    return target(*args)
