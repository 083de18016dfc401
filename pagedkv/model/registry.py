"""The model registry: Hugging Face architecture name -> the model class that runs it.

A new architecture is one model file (a class with the interface below, usually a subclass of
`LlamaForCausalLM` that overrides `config_overrides` and a layer or two) plus one line in
`_MODELS`. Entries are (module, class name), imported on first use, so reading a config never
imports every model.

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

if TYPE_CHECKING:
    import torch

    from pagedkv.model.attention import AttentionMetadata
    from pagedkv.model.ops import LayerOps
    from pagedkv.model.parallel.group import TensorParallelGroup
    from pagedkv.model.parallel.sharding import Shard

# architecture (config.json "architectures") -> (module, class)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("pagedkv.model.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("pagedkv.model.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("pagedkv.model.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("pagedkv.model.qwen3", "Qwen3ForCausalLM"),
    "Gemma2ForCausalLM": ("pagedkv.model.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("pagedkv.model.gemma3", "Gemma3ForCausalLM"),
}


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


def resolve_architecture(architectures: list[str] | tuple[str, ...]) -> str:
    """The first of config.json's `architectures` that is registered; ValueError naming them
    and the supported ones otherwise."""
    arch = next((a for a in architectures if a in _MODELS), None)
    if arch is None:
        named = ", ".join(map(repr, architectures)) if architectures else "(none named)"
        raise ValueError(f"architecture {named} is not supported; "
                         f"supported: {', '.join(_MODELS)}")
    return arch


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
