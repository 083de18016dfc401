"""ModelConfig: what the runtime needs from a Hugging Face model directory's config.json.

Reads config.json (and generation_config.json for eos ids), or a GGUF file's metadata (as the
same dict: pagedkv.model.gguf.config); never touches the network.
Both transformers 4 (`rope_theta`, `rope_scaling`, `torch_dtype`) and transformers 5
(`rope_parameters`, `dtype`) spellings are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from pagedkv.config import HFModelConfig, canonical_dtype
from pagedkv.config.dtypes import FP8_TORCH_DTYPE_NAMES, INT8_KV_DTYPE
from pagedkv.model.gguf import gguf_file
from pagedkv.model.json_files import read_json

# The torch side of the one dtype table (pagedkv.config.dtypes), keyed by canonical name.
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_ROPE_TYPES = ("default", "linear", "llama3")
# config.json sizes that must be positive integers (else tensors of negative or absurd shape).
_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim",
                  "max_position_embeddings")


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype the model computes in for a dtype name (any alias) or torch dtype."""
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype)
    try:
        name = canonical_dtype(dtype)
    except ValueError:
        name = None
    if name not in _TORCH_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return _TORCH_DTYPES[name]


def kv_cache_torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a KV cache of canonical dtype name `dtype`: a model dtype
    (`torch_dtype`), an fp8 name ("fp8" -> torch.float8_e4m3fn, as in vLLM) or "int8"."""
    if dtype == INT8_KV_DTYPE:
        return torch.int8
    if dtype in FP8_TORCH_DTYPE_NAMES:
        return getattr(torch, FP8_TORCH_DTYPE_NAMES[dtype])
    return torch_dtype(dtype)


def parse_dtype(dtype: str | torch.dtype, config_dtype: str) -> torch.dtype:
    """torch dtype for `dtype`; "auto" takes `config_dtype` (ModelConfig.torch_dtype, already
    resolved by the shared reader, so the KV planner sizes the same dtype)."""
    if isinstance(dtype, str) and dtype.strip().lower() == "auto":
        dtype = config_dtype
    return torch_dtype(dtype)


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


class ConfigAdapter(Protocol):
    """What parsing a config needs of its architecture's model class (the registry passes the
    class in: `pagedkv.model.registry.model_config_from_dict`)."""

    # The config.json activations it implements; the first is the architecture's default.
    hidden_activations: tuple[str, ...]

    def config_overrides(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """The architecture-specific fields (`qkv_bias`, `o_bias`, `qk_norm`)."""
        ...


def read_config_dicts(model_dir: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """`model_dir`/config.json and generation_config.json ({} when absent) as dicts, or a
    GGUF model's metadata as the same dicts (`model_dir` a .gguf file or a directory holding
    one)."""
    gguf = gguf_file(model_dir)
    if gguf is not None:
        from pagedkv.model.gguf.config import generation_config, hf_config
        from pagedkv.model.gguf.file import open_gguf

        return hf_config(open_gguf(gguf)), generation_config(open_gguf(gguf))
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"model directory not found: {model_dir}")
    cfg = read_json(model_dir / "config.json")
    gen_path = model_dir / "generation_config.json"
    return cfg, read_json(gen_path) if gen_path.is_file() else {}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of one model; `qkv_bias`, `o_bias` and `qk_norm` come from the
    architecture's config adapter (`config_overrides` of its registered class).

    `layer_sliding_windows[i]` is layer i's window (a token at position p sees positions
    p - W + 1 .. p) or None for full attention, and `torch_dtype` the canonical dtype name the
    config names: both come from `pagedkv.config.HFModelConfig`, the reader the KV spec uses
    too. `rope_scaling` is None or a dict with "rope_type" in ("linear", "llama3") and that
    type's parameters.
    """

    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    layer_sliding_windows: tuple[int | None, ...]
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    hf_config: HFModelConfig | None = field(default=None, compare=False, repr=False)

    @property
    def sliding_window(self) -> int | None:
        """The window of the sliding layers (None when every layer attends to everything)."""
        windows = [w for w in self.layer_sliding_windows if w is not None]
        return max(windows) if windows else None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], gen: dict[str, Any] | None, architecture: str,
                  model_class: ConfigAdapter) -> ModelConfig:
        """Parse an HF config dict (and a generation config dict) of `architecture`, whose
        registered `model_class` adapts it (see `pagedkv.model.registry.model_config_from_dict`,
        which resolves both)."""
        gen = gen or {}
        arch = architecture
        model_type = cfg.get("model_type", arch.removesuffix("ForCausalLM").lower())

        def req(key: str) -> Any:
            if key not in cfg:
                raise ValueError(f"config.json has no {key!r} (needed for {arch})")
            return cfg[key]

        for key in _POSITIVE_INTS:
            value = cfg.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value <= 0):
                raise ValueError(f"config.json: {key} must be a positive integer, got {value!r}")

        hidden = int(req("hidden_size"))
        hf = HFModelConfig.from_dict(cfg)
        heads, kv_heads = hf.num_heads, hf.num_kv_heads
        if heads % kv_heads != 0:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of "
                             f"num_key_value_heads {kv_heads}")
        act = (cfg.get("hidden_activation") or cfg.get("hidden_act")
               or model_class.hidden_activations[0])  # the architecture's default
        if act not in model_class.hidden_activations:
            raise ValueError(f"unsupported hidden_act {act!r} for {arch}; supported: "
                             f"{', '.join(model_class.hidden_activations)}")
        rope_theta, rope_scaling = _parse_rope(cfg)
        eos = _eos_list(gen.get("eos_token_id")) + _eos_list(cfg.get("eos_token_id"))
        eos_ids = tuple(dict.fromkeys(eos))
        bos = gen.get("bos_token_id", cfg.get("bos_token_id"))
        return cls(
            architecture=arch,
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=int(req("intermediate_size")),
            num_layers=hf.num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=hf.head_dim,
            vocab_size=int(req("vocab_size")),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            layer_sliding_windows=hf.layer_sliding_windows,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            **model_class.config_overrides(cfg),
            torch_dtype=hf.dtype,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            hf_config=hf,
        )


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"unsupported RoPE scaling type {rope_type!r}; supported: {_ROPE_TYPES}")
    if rope_type == "default":
        return theta, None
    out = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")}
    out["rope_type"] = rope_type
    if "factor" not in out:
        raise ValueError(f"RoPE scaling {rope_type!r} needs a 'factor'")
    return theta, out
