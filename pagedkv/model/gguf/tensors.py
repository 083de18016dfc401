"""A GGUF file's tensors under Hugging Face names, dequantized to float32.

llama.cpp's converter renames every tensor (`blk.3.attn_q.weight` for
`model.layers.3.self_attn.q_proj.weight`), permutes the rows of Llama's and Mistral's q/k
projections (its RoPE pairs neighbouring dims, Hugging Face's the two halves) and stores Gemma's
norm weights plus one. `hf_tensor` undoes all three, as transformers' own GGUF loader does, so
the loader reads a GGUF file as it reads safetensors: `GGUFCheckpoint` answers `keys()`,
`get_tensor(name)` and `get_slice(name)` as `safetensors.safe_open` does.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from pagedkv.model.gguf.file import GGUFFile

# GGUF tensor name -> Hugging Face name; "{i}" is the layer.
_TOP = {"token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
# Gemma 2/3 have four norms per layer; llama.cpp names them differently.
_GEMMA_LAYER = {**_LAYER, "ffn_norm": "pre_feedforward_layernorm",
                "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Architectures whose q/k rows llama.cpp permuted (LlamaModel.permute in convert_hf_to_gguf.py).
PERMUTED_QK = frozenset({"llama", "mistral"})
GEMMA = frozenset({"gemma2", "gemma3"})


def hf_names(gguf: GGUFFile) -> dict[str, str]:
    """Hugging Face name -> GGUF name of every tensor the models use (others, such as
    `rope_freqs.weight`, are left out)."""
    layer_names = _GEMMA_LAYER if gguf.architecture in GEMMA else _LAYER
    out: dict[str, str] = {}
    for name in gguf.tensors:
        if name in _TOP:
            out[_TOP[name]] = name
        elif (m := _BLOCK.match(name)) and m.group(2) in layer_names:
            out[f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"] = name
    return out


def dequantize(gguf: GGUFFile, name: str) -> torch.Tensor:
    """GGUF tensor `name` as a float32 torch tensor of its shape. ValueError naming the
    tensor and its type when the type cannot be dequantized."""
    info = gguf.tensors[name]
    data = gguf.data(name)
    if info.ggml_type == GGMLQuantizationType.F32:
        return torch.from_numpy(data.view(np.float32).copy()).reshape(info.shape)
    try:
        values = quants.dequantize(data, info.ggml_type)
    except NotImplementedError:
        raise ValueError(f"GGUF tensor {name!r} of {gguf.path} has quantization type "
                         f"{info.type_name}, which cannot be dequantized; supported: "
                         f"{', '.join(supported_types())}") from None
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(info.shape)


@functools.cache
def supported_types() -> list[str]:
    """The ggml types `dequantize` reads."""
    out = []
    for qtype in GGMLQuantizationType:
        try:
            quants.dequantize(np.zeros((1, quants.GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
        except (NotImplementedError, KeyError, ValueError):
            continue
        out.append(qtype.name)
    return out


def check_types(gguf: GGUFFile) -> None:
    """ValueError naming the first tensor whose quantization type cannot be dequantized."""
    supported = set(supported_types())
    for name, info in gguf.tensors.items():
        if info.type_name not in supported:
            raise ValueError(f"GGUF tensor {name!r} of {gguf.path} has quantization type "
                             f"{info.type_name}, which pagedkv cannot dequantize; supported: "
                             f"{', '.join(sorted(supported))}")


def _unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (each head's rows interleaved pairwise)."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _permuted_heads(gguf: GGUFFile, hf_name: str) -> int | None:
    """The head count whose rows llama.cpp permuted in tensor `hf_name` (None: not permuted)."""
    if gguf.architecture not in PERMUTED_QK:
        return None
    if ".self_attn.q_proj." in hf_name:
        return int(gguf.arch_value("attention.head_count"))
    if ".self_attn.k_proj." in hf_name:
        return int(gguf.arch_value("attention.head_count_kv",
                                   gguf.arch_value("attention.head_count")))
    return None


def hf_tensor(gguf: GGUFFile, hf_name: str, gguf_name: str) -> torch.Tensor:
    """The Hugging Face checkpoint's tensor `hf_name`, from GGUF tensor `gguf_name`."""
    tensor = dequantize(gguf, gguf_name)
    heads = _permuted_heads(gguf, hf_name)
    if heads is not None:
        tensor = _unpermute(tensor, heads)
    elif gguf.architecture in GEMMA and hf_name.endswith("norm.weight"):
        tensor = tensor - 1.0
    return tensor


def hf_rows(gguf: GGUFFile, hf_name: str, gguf_name: str) -> np.ndarray:
    """The Hugging Face matrix `hf_name`'s rows as GGUF tensor `gguf_name` stores them, still
    quantized: uint8 [rows, bytes per row], in Hugging Face's row order (q/k unpermuted)."""
    rows = gguf.data(gguf_name)
    heads = _permuted_heads(gguf, hf_name)
    if heads is None:
        return np.ascontiguousarray(rows)
    return _unpermute(torch.from_numpy(np.array(rows)), heads).numpy()


def rope_factors(gguf: GGUFFile) -> torch.Tensor | None:
    """Llama 3.1-style RoPE scaling as llama.cpp stores it: `rope_freqs.weight`, one factor per
    rotary frequency, each inverse frequency divided by its factor (None when absent)."""
    if "rope_freqs.weight" not in gguf.tensors:
        return None
    return dequantize(gguf, "rope_freqs.weight").flatten()


@dataclass
class _Slice:
    """`safe_open(...).get_slice(name)`'s answer: the shape, and indexing that reads."""

    checkpoint: GGUFCheckpoint
    name: str

    def get_shape(self) -> list[int]:
        return list(self.checkpoint.shape(self.name))

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.checkpoint.get_tensor(self.name)[index]


class GGUFCheckpoint:
    """A GGUF file seen as a safetensors checkpoint with Hugging Face tensor names."""

    def __init__(self, gguf: GGUFFile) -> None:
        self.gguf = gguf
        self._names = hf_names(gguf)

    def keys(self) -> list[str]:
        return list(self._names)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.gguf.tensors[self._names[name]].shape

    def get_tensor(self, name: str) -> torch.Tensor:
        return hf_tensor(self.gguf, name, self._names[name])

    def gguf_name(self, name: str) -> str:
        """The GGUF tensor Hugging Face tensor `name` is read from."""
        return self._names[name]

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self, name)
