"""A profiled model of the work, calibrated to a real server's logged steps.

`pagedkv profile MODEL` times the model runner (and the engine's own work around it) on a grid;
a server's steps take longer: its serving loop hands every output to the event loop, which
competes with the engine thread for the GIL, and on a shared machine other processes take a
share of the cores. `calibrate(model, shapes, times)` fits, on a short real run's step log
(`pagedkv serve --step-log`), the three numbers that separate the two:

    server step = share x profiled step + per_step + per_request x requests in the step

(non-negative least squares, rows weighted as `FittedLatency.fit` weighs them), and returns
the profiled model with them folded into its coefficients. The shape of the work (prefill vs
decode, attention context) stays the profile's: the run only has to cover the serving costs,
not every step shape. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.sim.latency.base import StepShape
from pagedkv.sim.latency.fitted import FittedLatency, nonnegative_least_squares


def calibrate(model: FittedLatency, shapes: Sequence[StepShape],
              times: Sequence[float]) -> FittedLatency:
    """`model` fitted to a server's steps (`shapes`, `times`) as the module docstring says;
    `meta["calibration"]` holds share, per_step and per_request. ValueError with fewer than 3
    steps or a step time <= 0."""
    import numpy as np

    if len(shapes) != len(times) or len(shapes) < 3:
        raise ValueError(f"calibration needs at least 3 (shape, time) steps, got "
                         f"{len(shapes)} shapes and {len(times)} times")
    y = np.array(times, dtype=float)
    if not (y > 0).all():
        raise ValueError("step times must be > 0")
    x = np.array([[model.step_time(s), 1.0, float(s.decode_seqs + s.prefill_seqs)]
                  for s in shapes])
    coef = nonnegative_least_squares(x, y, 1.0 / np.sqrt(y), [0, 1, 2])
    share, per_step, per_request = (float(v) for v in coef)
    c = {k: v * share for k, v in model.coefficients.items()}
    c["intercept"] += per_step
    c["decode_seqs"] += per_request
    c["prefill_seqs"] += per_request
    predicted = x @ coef
    meta = {**model.meta, "calibration": {
        "share": share, "per_step": per_step, "per_request": per_request, "steps": len(y),
        "mean_rel_error": float((np.abs(predicted - y) / y).mean()),
        "total_ratio": float(predicted.sum() / y.sum())}}
    return FittedLatency(c, meta, model.frontend)
