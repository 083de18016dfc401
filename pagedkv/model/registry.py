"""The model registry: Hugging Face architecture name -> the model class that runs it.

A new architecture is one model file (a class with the interface below, usually a subclass of
`LlamaForCausalLM` that overrides `config_overrides` and a layer or two) plus one line in
`MODELS` (registry_names.py, torch-free). Entries are (module, class name), imported on first
use, so reading a config never imports every model.

The interface a model class provides (see `CausalLM`): it is built from a `ModelConfig`;
`config_overrides(hf_config)` is its config adapter, the architecture-specific `ModelConfig`
fields (biases, q/k norm) read from the config.json dict; `forward`, `compute_logits`,
`checkpoint_mapping` / `checkpoint_splits` / `checkpoint_shards` (how Hugging Face tensors
become its parameters, and which slice a tensor-parallel rank loads)
and `pack_linear_weights`.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pagedkv.model.config import ModelConfig, read_config_dicts
from pagedkv.model.registry_names import MODELS, resolve_architecture

if TYPE_CHECKING:
    import torch

    from pagedkv.model.attention import AttentionMetadata
    from pagedkv.model.ops import LayerOps
    from pagedkv.model.parallel.group import TensorParallelGroup
    from pagedkv.model.parallel.sharding import Shard

_MODELS = MODELS  # the one table, in registry_names.py (torch-free)


class CausalLM(Protocol):
    """What the loader and the runner use of a model class (see the module docstring)."""

    # The elementwise kernels its layers run (the runner turns the fused CPU ones on).
    ops: LayerOps
    # The config.json activations (`hidden_activation` or `hidden_act`) it implements.
    hidden_activations: tuple[str, ...]
    # Optional `attention_reads_kv_cache` (bool, False when absent): its attention stores and
    # reads a cache of any format itself, so the runner never wraps the backend (gemma2.py).

    def __init__(self, cfg: ModelConfig, tp: TensorParallelGroup | None = None) -> None: ...

    @classmethod
    def config_overrides(cls, hf_config: dict[str, Any]) -> dict[str, Any]: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def checkpoint_mapping(self) -> dict[str, list[str]]: ...

    def checkpoint_splits(self, param_name: str) -> list[int]: ...

    def checkpoint_shards(self, param_name: str) -> list[Shard | None] | None: ...

    def pack_linear_weights(self, panels: bool = False) -> int: ...


def supported_architectures() -> tuple[str, ...]:
    """Every architecture name the registry knows, in registration order."""
    return tuple(_MODELS)


def get_model_class(architecture: str) -> type[CausalLM]:
    """The model class registered for `architecture` (imported on first use)."""
    module, name = _MODELS[resolve_architecture([architecture])]
    return getattr(importlib.import_module(module), name)


def model_config_from_dict(cfg: dict[str, Any], gen: dict[str, Any] | None = None
                           ) -> ModelConfig:
    """Parse an HF config dict (and a generation config dict) with its architecture's config
    adapter. ValueError naming an unsupported architecture or a bad field."""
    architecture = resolve_architecture(cfg.get("architectures") or [])
    return ModelConfig.from_dict(cfg, gen, architecture, get_model_class(architecture))


def model_config_from_dir(model_dir: str | Path) -> ModelConfig:
    """Parse `model_dir`/config.json (+ generation_config.json when present), or a GGUF
    model's metadata (`model_dir` a .gguf file or a directory holding one)."""
    return model_config_from_dict(*read_config_dicts(model_dir))
