"""What a model runner is built from: a plain, frozen `RunnerConfig` (built once by the engine;
pickled to every tensor-parallel rank, each of which builds its runner from it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedkv.kv.spec import KVCacheSpec
from pagedkv.store.config import StoreConfig


@dataclass(frozen=True)
class RunnerConfig:
    """`ModelRunner`'s settings (see its constructor), the same on every rank but `device`.

    `kv_cache_spec`: one rank's KV cache spec (None: built from the model's config);
    `kv_store`: the KV store each rank builds over its KV cache once that exists (None: no
    store)."""

    model: str
    block_size: int
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    kv_cache_spec: KVCacheSpec | None = None
    cpu_kernels: str = "auto"
    cpu_threads: int | None = None
    kv_cache_dtype: str = "auto"
    kv_store: StoreConfig | None = None
    quantization: str = "auto"

    def runner_kwargs(self) -> dict[str, Any]:
        """`ModelRunner`'s keyword arguments (no KV cache yet: `num_blocks=None`)."""
        return dict(block_size=self.block_size, num_blocks=None, dtype=self.dtype,
                    device=self.device, seed=self.seed, kv_cache_spec=self.kv_cache_spec,
                    cpu_kernels=self.cpu_kernels, cpu_threads=self.cpu_threads,
                    kv_cache_dtype=self.kv_cache_dtype, kv_store=self.kv_store,
                    quantization=self.quantization)
