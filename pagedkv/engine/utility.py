"""The engine core's utility calls: what a frontend may ask the core between its steps, the
same in both core clients (in-process and core process).

A name is an `EngineCore` method ("get_stats"), a dotted path to a method of one of its parts
("dashboard.drain": `EngineCore.dashboard`, pagedkv/engine/dashboard_calls.py) or one of
CORE_FUNCTIONS, called with the core ("cpu_kernel_choice"). Arguments and results must be
msgpack-able (ints, floats, strings, lists, dicts, msgspec structs): across processes they
travel encoded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedkv.engine.runner_facts import kernel_choice

# Every utility call a frontend may make (anything else is a ValueError).
UTILITY_METHODS = frozenset({
    "get_stats", "check_invariants", "is_prefix_cached", "pin_prefix", "unpin_prefix", "now",
    "dashboard.subscribe", "dashboard.unsubscribe", "dashboard.drain", "dashboard.block_table",
    "dashboard.explain", "dashboard.explain_recent", "cpu_kernel_choice", "get_core_stats",
    "kv_transfer.describe", "kv_transfer.start_handoff", "kv_transfer.poll_handoff",
    "kv_transfer.held_blocks", "kv_transfer.stats", "kv_transfer.abandon_handoff",
})
# Utility calls answered by a function of the core rather than by one of its methods.
CORE_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "cpu_kernel_choice": lambda core: kernel_choice(core.runner),
    # Each engine core's stats (a data-parallel client lists every core's; here: this one).
    "get_core_stats": lambda core: [core.get_stats()],
}


def run_utility(core: Any, method: str, args: list[Any] | tuple[Any, ...]) -> Any:
    """Call `core.<method>(*args)` (or CORE_FUNCTIONS[method](core, *args)) and return its result; whatever the method mutates, this
    mutates. ValueError naming `method` when it is not a utility call."""
    if method not in UTILITY_METHODS:
        raise ValueError(f"unknown utility method {method!r}")
    if method in CORE_FUNCTIONS:
        return CORE_FUNCTIONS[method](core, *args)
    target = core
    for part in method.split("."):
        target = getattr(target, part)
    return target(*args)
