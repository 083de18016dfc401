"""A latency model fitted to this engine's own step timings (`pagedkv profile MODEL`).

time = sum_i coef_i x feature_i over `FEATURE_NAMES` (intercept, prefill tokens, prefill
chunks (each chunk's own host and kernel-launch work), prefill attention work, decode
sequences, decode context, swapped blocks, blocks saved to the KV store, prefill attention
against the KV cached before each chunk; a model saved before a feature existed has 0 for
it), fitted by least
squares with non-negative coefficients, from `pagedkv profile`'s grid or a real run's step
log, saved as JSON, with the serving frontend's delays when fitted from a request log too
(`pagedkv.sim.frontend`; the simulator applies them):

    {"kind": "fitted", "coefficients": {"intercept": ..., ...}, "meta": {...},
     "frontend": {"admit": ..., "output": ...}}
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedkv.sim.frontend import NO_DELAYS, FrontendDelays
from pagedkv.sim.latency.base import FEATURE_NAMES, StepShape


class FittedLatency:
    name = "fitted"

    def __init__(self, coefficients: dict[str, float], meta: dict[str, Any] | None = None,
                 frontend: FrontendDelays = NO_DELAYS) -> None:
        unknown = set(coefficients) - set(FEATURE_NAMES)
        if unknown:
            raise ValueError(f"unknown latency coefficients {sorted(unknown)}; "
                             f"known: {list(FEATURE_NAMES)}")
        self.coefficients = {k: float(coefficients.get(k, 0.0)) for k in FEATURE_NAMES}
        self.meta = dict(meta or {})
        self.frontend = frontend
        c = self.coefficients
        self._c = tuple(c[k] for k in FEATURE_NAMES)

    def step_time(self, shape: StepShape) -> float:
        c0, c1, c2, c3, c4, c5, c6, c7, c8 = self._c
        return (c0 + c1 * shape.prefill_tokens + c2 * shape.prefill_seqs
                + c3 * shape.prefill_attention + c4 * shape.decode_seqs
                + c5 * shape.decode_context + c6 * shape.swapped_blocks
                + c7 * shape.saved_blocks + c8 * shape.prefill_past)

    @classmethod
    def fit(cls, shapes: Sequence[StepShape], times: Sequence[float],
            meta: dict[str, Any] | None = None, *, relative: bool = False,
            absolute: bool = False) -> FittedLatency:
        """Non-negative weighted least squares of `times` on the shapes' features (features
        that never vary in the samples get 0); the fit's errors go into `meta`. `relative`
        weighs each sample by 1 / time (each step's relative error counts alike: for a grid
        that holds as many short shapes as long ones); `absolute` weighs them alike (the fit
        keeps the steps' total: for a log of steps all about one size, such as a decode
        instance's, whose times vary with what else runs on the machine, and whose mean is
        what TPOT is); else 1 / sqrt(time) (for a real run's log of long prefill steps among
        many short decode steps). ValueError with fewer samples than features, or with both
        `relative` and `absolute`."""
        import numpy as np

        if relative and absolute:
            raise ValueError("a fit is either relative or absolute, not both")
        if len(shapes) != len(times) or len(shapes) < len(FEATURE_NAMES):
            raise ValueError(f"need at least {len(FEATURE_NAMES)} (shape, time) samples, got "
                             f"{len(shapes)} shapes and {len(times)} times")
        x = np.array([s.features() for s in shapes], dtype=float)
        y = np.array(times, dtype=float)
        if (y <= 0).any():
            raise ValueError("step times must be > 0")
        # On a real run's log, rows weighted by 1 / sqrt(time): between relative error per
        # step (1 / time: the many short decode steps rule and the long prefill steps' total
        # comes out short) and absolute error (the long steps rule and short ones are off by
        # half). On a balanced grid, 1 / time: with 1 / sqrt(time) the few long prefill
        # points pull the intercept down and a small decode step came out 40% short.
        weight = 1.0 / y if relative else np.ones_like(y) if absolute else 1.0 / np.sqrt(y)
        active = [j for j in range(x.shape[1]) if j == 0 or np.ptp(x[:, j]) > 0]
        coef = nonnegative_least_squares(x, y, weight, active)
        predicted = x @ coef
        rel = np.abs(predicted - y) / np.maximum(y, 1e-9)
        meta = dict(meta or {})
        meta.update(samples=len(y), mean_rel_error=float(rel.mean()),
                    max_rel_error=float(rel.max()), total_ratio=float(predicted.sum() / y.sum()))
        return cls(dict(zip(FEATURE_NAMES, coef.tolist(), strict=True)), meta)

    def with_frontend(self, frontend: FrontendDelays) -> FittedLatency:
        """The same step model with these frontend delays."""
        return FittedLatency(self.coefficients, self.meta, frontend)

    def to_dict(self) -> dict[str, Any]:
        out = {"kind": "fitted", "coefficients": self.coefficients, "meta": self.meta}
        if not self.frontend.is_zero:
            out["frontend"] = self.frontend.to_dict()
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> FittedLatency:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"latency model {str(path)!r} is not JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("kind") != "fitted" \
                or not isinstance(data.get("coefficients"), dict):
            raise ValueError(f"latency model {str(path)!r} is not a fitted model "
                             "(expected {\"kind\": \"fitted\", \"coefficients\": {...}})")
        frontend = data.get("frontend")
        try:
            delays = NO_DELAYS if frontend is None else FrontendDelays.from_dict(frontend)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"latency model {str(path)!r}: {exc}") from None
        return cls(data["coefficients"], data.get("meta"), delays)


def nonnegative_least_squares(x: Any, y: Any, weight: Any, active: list[int]) -> Any:
    """Coefficients >= 0 minimising the weighted squared error of `x @ coef` against `y`
    (numpy arrays), over the columns in `active` (others 0): least squares, then the most
    negative column dropped until none is (columns scaled to 1 for the solve). Mutates
    `active`."""
    import numpy as np

    xw, yw = x * weight[:, None], y * weight
    coef = np.zeros(x.shape[1])
    while active:
        scale = np.maximum(np.abs(xw[:, active]).max(axis=0), 1e-300)
        sol = np.linalg.lstsq(xw[:, active] / scale, yw, rcond=None)[0] / scale
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef
