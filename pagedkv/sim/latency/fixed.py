"""A latency model from a plain function of the step shape (tests, what-if studies)."""

from __future__ import annotations

from collections.abc import Callable

from pagedkv.sim.latency.base import StepShape


class FunctionLatency:
    """`step_time(shape) = fn(shape)`: e.g. `FunctionLatency(lambda s: 1e-3 + 1e-5 * s.num_tokens)`."""

    name = "function"

    def __init__(self, fn: Callable[[StepShape], float]) -> None:
        self.fn = fn

    def step_time(self, shape: StepShape) -> float:
        return self.fn(shape)


class LinearLatency:
    """time = intercept + per_token * tokens + per_context * (decode context + prefill
    attention): a simple default when nothing was profiled."""

    name = "linear"

    def __init__(self, intercept: float = 2e-3, per_token: float = 5e-5,
                 per_context: float = 1e-8) -> None:
        for label, value in (("intercept", intercept), ("per_token", per_token),
                             ("per_context", per_context)):
            if not value >= 0:
                raise ValueError(f"{label} must be >= 0, got {value!r}")
        self.intercept, self.per_token, self.per_context = intercept, per_token, per_context

    def step_time(self, shape: StepShape) -> float:
        return (self.intercept + self.per_token * shape.num_tokens
                + self.per_context * (shape.decode_context + shape.prefill_attention))
