"""The latency model seam: one step's shape in, its duration out.

`StepShape.of(scheduler_output)` (pagedkv/engine/step_shape.py, which the engine's step log
writes too) reads what a step computes from the scheduler's batch. A latency model is any object with `name` and `step_time(shape) -> seconds`
(`LatencyModel`); implementations live one per file and register in `LATENCY_MODELS`.
"""

from __future__ import annotations

from typing import Protocol

from pagedkv.engine.step_shape import FEATURE_NAMES, StepShape

__all__ = ["FEATURE_NAMES", "LatencyModel", "StepShape"]


class LatencyModel(Protocol):
    """Duration in seconds of one step of the given shape; pure (same shape, same answer)."""

    name: str

    def step_time(self, shape: StepShape) -> float: ...
