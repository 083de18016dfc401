"""Tiny random-weight Hugging Face model directories for tests, built with transformers itself.

Each spec is built once per test session (see the fixtures in tests/conftest.py): the config
dict comes from `pagedkv.testing.random_model`, transformers initialises the model from it, the
norm weights and biases are perturbed (so a loader that ignores them fails), and the result is
saved with `save_pretrained` next to our byte-level BPE tokenizer files. Tests can then compare
pagedkv against transformers on transformers' own checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pagedkv.testing.random_model import build_tokenizer_files, hf_config_dict, tokenizer_vocab_size

_BASE: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, max_position_embeddings=2048, sliding_window=None,
    tie_word_embeddings=False, dtype="float32", rope_scaling=None,
)

# name -> (arch, overrides of _BASE)
TINY_SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    # MQA, tied embeddings, llama3 RoPE scaling.
    "llama_mqa": ("llama", dict(num_kv_heads=1, tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "qwen2": ("qwen2", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # Explicit head_dim different from hidden / heads, q/k norm, tied embeddings, GQA 4.
    "qwen3": ("qwen3", dict(head_dim=32, num_kv_heads=1, tie_word_embeddings=True)),
    "mistral": ("mistral", dict(sliding_window=8)),
    # Mixed layers: layer 0 attends fully, layers 1 and 2 slide over 8 tokens.
    "qwen2_mixed": ("qwen2", dict(num_layers=3, sliding_window=8, max_window_layers=1)),
    # Head size 64 (the CPU's tiled prefill kernel), GQA 5: layer 0 full, layer 1 slides over 8.
    "qwen2_hd64": ("qwen2", dict(num_layers=2, head_dim=64, num_heads=5, num_kv_heads=1,
                                 sliding_window=8, max_window_layers=1)),
    # Gemma 2: sliding (window 8) and full layers alternate; soft-capping; tied embeddings.
    "gemma2": ("gemma2", dict(num_layers=4, sliding_window=8, tie_word_embeddings=True)),
    # Gemma 3: q/k norms, local and global RoPE; 5 sliding layers (window 8) per full one.
    "gemma3": ("gemma3_text", dict(num_layers=6, sliding_window=8, tie_word_embeddings=True)),
    # Gemma 3 with one KV head (tensor parallel: replicated on every rank).
    "gemma3_mqa": ("gemma3_text", dict(num_layers=6, sliding_window=8, num_kv_heads=1,
                                       tie_word_embeddings=True)),
}


def build_tiny_hf_model(model_dir: str | Path, name: str, *, seed: int = 0) -> Path:
    """Build the tiny model `name` (a key of TINY_SPECS) into `model_dir` with transformers."""
    arch, overrides = TINY_SPECS[name]
    return build_hf_model(model_dir, arch, seed=seed, **overrides)


def build_hf_model(model_dir: str | Path, arch: str, *, seed: int = 0, init_std: float = 0.08,
                   **overrides: Any) -> Path:
    """Build a random `arch` model (hf_config_dict's names; `overrides` of _BASE's shape) into
    `model_dir` with transformers: projections and embeddings drawn with std `init_std`, norm
    weights and biases perturbed. Returns the path."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = build_tokenizer_files(model_dir)
    spec = {**_BASE, **overrides}
    cfg = hf_config_dict(arch, vocab_size=tokenizer_vocab_size(model_dir), **spec)
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("norm.weight"):
                param.add_(0.1 * torch.randn(param.shape, generator=gen))
            elif pname.endswith(".bias"):
                param.copy_(0.02 * torch.randn(param.shape, generator=gen))
            elif pname.endswith(("embed_tokens.weight", "_proj.weight", "lm_head.weight")):
                # A larger init than HF's 0.02 keeps logits far from ties.
                param.copy_(init_std * torch.randn(param.shape, generator=gen))
    model.save_pretrained(model_dir, safe_serialization=True)
    gen_cfg = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
    (model_dir / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    return model_dir


def load_hf_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' model for `model_dir`, in eval mode (eager attention, the reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                 attn_implementation="eager")
    return model.eval()
