"""Latency models of the simulator, behind one interface (`LatencyModel.step_time`).

`make_latency_model(spec, model_config)` builds one from a command-line spec:

- a path to a JSON file saved by `pagedkv profile` -> `FittedLatency`;
- `roofline:HARDWARE` (`roofline:h100`, `roofline:cpu`, `roofline:my_gpu.json`) -> the
  roofline of the simulated model's config on that machine;
- `linear` -> a fixed linear model (no profile needed; for quick what-ifs).

A new model is a new file here and one entry in `LATENCY_MODELS`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pagedkv.sim.latency.base import FEATURE_NAMES, LatencyModel, StepShape
from pagedkv.sim.latency.fitted import FittedLatency
from pagedkv.sim.latency.fixed import FunctionLatency, LinearLatency
from pagedkv.sim.latency.roofline import HARDWARE_PRESETS, Hardware, ModelShape, RooflineLatency


def _roofline(arg: str, config: dict[str, Any] | None, kv_cache_dtype: str) -> LatencyModel:
    from pagedkv.sim.latency.roofline import load_hardware

    if config is None:
        raise ValueError("the roofline latency model needs the model's config (--model)")
    return RooflineLatency(ModelShape.from_config(config, kv_cache_dtype=kv_cache_dtype),
                           load_hardware(arg or "h100"))


# Each factory takes (the spec's argument, the model's config, the KV cache's format).
LATENCY_MODELS: dict[str, Callable[[str, dict[str, Any] | None, str], LatencyModel]] = {
    "roofline": _roofline,
    "linear": lambda arg, config, kv_cache_dtype: LinearLatency(),
    "fitted": lambda arg, config, kv_cache_dtype: FittedLatency.load(arg),
}


def make_latency_model(spec: str, config: dict[str, Any] | None = None, *,
                       kv_cache_dtype: str = "auto") -> LatencyModel:
    """See the module docstring; `kv_cache_dtype` (vLLM's names) sets the bytes a roofline's
    decode reads per cached token. ValueError naming the spec when it fits no model."""
    if Path(spec).is_file():
        return FittedLatency.load(spec)
    kind, _, arg = spec.partition(":")
    factory = LATENCY_MODELS.get(kind)
    if factory is None:
        raise ValueError(f"unknown latency model {spec!r}: give a JSON file from `pagedkv "
                         f"profile` or one of {[k + ':...' if k != 'linear' else k for k in LATENCY_MODELS]}")
    return factory(arg, config, kv_cache_dtype)


__all__ = ["FEATURE_NAMES", "HARDWARE_PRESETS", "LATENCY_MODELS", "FittedLatency",
           "FunctionLatency", "Hardware", "LatencyModel", "LinearLatency", "ModelShape",
           "RooflineLatency", "StepShape", "make_latency_model"]
