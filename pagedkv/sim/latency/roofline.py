"""A roofline latency model: a step takes the longer of its compute and its memory traffic on
a described machine, plus a fixed per-step overhead.

    compute = (2 x params x tokens + 4 x layers x q_width x attended positions) / (flops x mfu)
    memory  = (weights bytes + KV bytes read + KV bytes written + swapped bytes) / (bw x mbu)
    step    = overhead + max(compute, memory)

For machines not at hand (an H100 preset) and for this CPU (`measure_cpu_hardware`, numpy
matmul and copy ceilings). Accurate to the shape of the curve, not to a few percent: a fitted
model (`pagedkv profile`) is the one to trust on a machine you have.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from pagedkv.config.dtypes import dtype_bytes, resolve_dtype
from pagedkv.config.hf_config import HFModelConfig
from pagedkv.kv.hf_spec import kv_cache_spec_from_hf_config
from pagedkv.kv.plan import estimate_num_params
from pagedkv.model.config_files import load_hf_config
from pagedkv.sim.latency.base import StepShape


@dataclass(frozen=True)
class Hardware:
    """A machine's ceilings: dense FLOP/s at the model dtype, memory bytes/s, the fractions
    of each a real step reaches, and a fixed per-step overhead (scheduling, launches)."""

    name: str
    flops: float
    memory_bandwidth: float
    memory_bytes: int = 0
    mfu: float = 0.5
    mbu: float = 0.7
    step_overhead: float = 2e-3

    def __post_init__(self) -> None:
        for field in ("flops", "memory_bandwidth", "mfu", "mbu"):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"hardware {field} must be > 0, got {value!r}")
        if not (isinstance(self.step_overhead, (int, float)) and self.step_overhead >= 0):
            raise ValueError(f"hardware step_overhead must be >= 0, got {self.step_overhead!r}")
        if isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, (int, float)) \
                or not 0 <= self.memory_bytes < float("inf"):
            raise ValueError(f"hardware memory_bytes must be >= 0, got {self.memory_bytes!r}")
        object.__setattr__(self, "memory_bytes", int(self.memory_bytes))  # 80e9 from JSON


HARDWARE_PRESETS: dict[str, Hardware] = {
    # NVIDIA H100 SXM: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 80 GB.
    "h100": Hardware("h100", flops=989e12, memory_bandwidth=3.35e12, memory_bytes=80 << 30,
                     mfu=0.5, mbu=0.75, step_overhead=3e-3),
    # NVIDIA A100 SXM 80GB: 312 TFLOP/s dense bf16, 2.04 TB/s.
    "a100": Hardware("a100", flops=312e12, memory_bandwidth=2.04e12, memory_bytes=80 << 30,
                     mfu=0.5, mbu=0.75, step_overhead=3e-3),
}


def measure_cpu_hardware(seconds: float = 0.5) -> Hardware:
    """This CPU's float32 matmul FLOP/s and copy bandwidth, measured with numpy (about
    2 x `seconds`); the fractions are 1 since these are achieved, not peak, figures."""
    import numpy as np

    n = 512
    a = np.random.default_rng(0).random((n, n), dtype=np.float32)
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ a
        runs += 1
    flops = 2 * n ** 3 * runs / (time.perf_counter() - start)
    buf = np.zeros(32 << 20, dtype=np.uint8)
    dst = np.empty_like(buf)
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        np.copyto(dst, buf)
        runs += 1
    bandwidth = 2 * buf.nbytes * runs / (time.perf_counter() - start)
    return Hardware("cpu", flops=flops, memory_bandwidth=bandwidth, mfu=1.0, mbu=1.0,
                    step_overhead=2e-3)


def load_hardware(spec: str) -> Hardware:
    """A preset name ("h100"), "cpu" (measured now), or a JSON file of `Hardware` fields."""
    if spec in HARDWARE_PRESETS:
        return HARDWARE_PRESETS[spec]
    if spec == "cpu":
        return measure_cpu_hardware()
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"unknown hardware {spec!r}: give a preset "
                         f"({', '.join([*HARDWARE_PRESETS, 'cpu'])}) or a JSON file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"hardware file {spec!r} is not JSON: {exc}") from None
    known = {f.name for f in fields(Hardware)}
    if not isinstance(data, dict) or set(data) - known:
        unknown = sorted(set(data) - known) if isinstance(data, dict) else data
        raise ValueError(f"hardware file {spec!r}: unknown fields {unknown!r}; expected an "
                         f"object with {sorted(known - {'name'})}")
    try:
        return Hardware(**{"name": path.stem, **data})
    except TypeError as exc:  # a required field missing
        raise ValueError(f"hardware file {spec!r}: {exc}; expected flops and "
                         "memory_bandwidth at least") from None


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs from a model config."""

    num_params: int
    num_layers: int
    q_width: int  # heads x head_dim
    kv_bytes_per_token: int
    weight_bytes: int

    @classmethod
    def from_config(cls, config: dict[str, Any], dtype: str = "auto",
                    kv_cache_dtype: str = "auto") -> ModelShape:
        """The shape of `config`'s model with weights in `dtype` and a KV cache of
        `kv_cache_dtype` ("auto": the weights' dtype; int8 counts its scales)."""
        hf = HFModelConfig.from_dict(config)
        resolved = resolve_dtype(dtype, config)
        spec = kv_cache_spec_from_hf_config(config, 16, resolved, kv_cache_dtype)
        params = estimate_num_params(config)
        return cls(num_params=params, num_layers=hf.num_layers,
                   q_width=hf.num_heads * hf.head_dim, kv_bytes_per_token=spec.bytes_per_token,
                   weight_bytes=params * dtype_bytes(resolved))

    @classmethod
    def load(cls, config_path: str, dtype: str = "auto") -> ModelShape:
        return cls.from_config(load_hf_config(config_path), dtype)


class RooflineLatency:
    name = "roofline"

    def __init__(self, model: ModelShape, hardware: Hardware) -> None:
        self.model = model
        self.hardware = hardware
        hw = hardware
        self._flop_s = 1.0 / (hw.flops * hw.mfu)
        self._byte_s = 1.0 / (hw.memory_bandwidth * hw.mbu)

    def step_time(self, shape: StepShape) -> float:
        m = self.model
        tokens = shape.num_tokens
        if tokens == 0 and shape.swapped_blocks == 0:
            return self.hardware.step_overhead
        attended = shape.prefill_attention + shape.decode_context
        compute = (2.0 * m.num_params * tokens + 4.0 * m.num_layers * m.q_width * attended)
        kv_read = (shape.decode_context + shape.prefill_tokens) * m.kv_bytes_per_token
        memory = m.weight_bytes + kv_read + tokens * m.kv_bytes_per_token
        return (self.hardware.step_overhead
                + max(compute * self._flop_s, memory * self._byte_s))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "roofline", "model": asdict(self.model),
                "hardware": asdict(self.hardware)}
