"""A GGUF file's metadata as the Hugging Face config.json (and generation_config.json) dict the
rest of pagedkv reads: the same keys transformers' GGUF loader produces, plus what llama.cpp
derives from the architecture (Gemma's attention scale and softcaps, Qwen 3's head size).
"""

from __future__ import annotations

from typing import Any

from pagedkv.model.gguf.file import GGUFFile

# GGUF `general.architecture` -> (config.json "architectures", "model_type").
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
# `<arch>.<key>` -> config.json key.
_SIZES = {"block_count": "num_hidden_layers", "embedding_length": "hidden_size",
          "feed_forward_length": "intermediate_size",
          "attention.head_count": "num_attention_heads",
          "attention.head_count_kv": "num_key_value_heads",
          "attention.layer_norm_rms_epsilon": "rms_norm_eps",
          "context_length": "max_position_embeddings", "rope.freq_base": "rope_theta",
          "attention.key_length": "head_dim", "attention.sliding_window": "sliding_window",
          "attn_logit_softcapping": "attn_logit_softcapping",
          "final_logit_softcapping": "final_logit_softcapping"}
# The unquantized ggml types and their dtypes, widest first: what "auto" takes for a float file
# (GGUF has no config.json torch_dtype; see `gguf_dtype`).
FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
# Gemma's 27B models scale queries by hidden_size / heads, the others by head_dim (llama.cpp:
# LLM_TYPE_27B in llama-model.cpp); their layer counts tell them apart.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def check_architecture(gguf: GGUFFile) -> str:
    """The file's architecture, or ValueError naming it and the supported ones."""
    arch = gguf.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} of {gguf.path} is not supported; "
                         f"supported: {', '.join(ARCHITECTURES)}")
    return arch


def hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """The config.json dict of the model in `gguf` (ValueError for an unsupported
    architecture)."""
    arch = check_architecture(gguf)
    architecture, model_type = ARCHITECTURES[arch]
    cfg: dict[str, Any] = {"architectures": [architecture], "model_type": model_type}
    for key, hf_key in _SIZES.items():
        value = gguf.arch_value(key)
        if value is not None:
            cfg[hf_key] = value
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    cfg["vocab_size"] = gguf.arch_value("vocab_size") or (len(tokens) if tokens else None)
    cfg["torch_dtype"] = gguf_dtype(gguf)
    cfg["tie_word_embeddings"] = "output.weight" not in gguf.tensors
    cfg["attention_bias"] = "blk.0.attn_q.bias" in gguf.tensors
    scaling = gguf.arch_value("rope.scaling.type")
    if scaling not in (None, "none"):
        cfg["rope_scaling"] = {"rope_type": scaling,
                               "factor": gguf.arch_value("rope.scaling.factor")}
    for name in ("bos", "eos", "padding"):
        token = gguf.metadata.get(f"tokenizer.ggml.{name}_token_id")
        if token is not None:
            cfg["pad_token_id" if name == "padding" else f"{name}_token_id"] = token
    if arch in _GEMMA_27B_LAYERS:
        _gemma(cfg, arch)
    return cfg


def gguf_dtype(gguf: GGUFFile) -> str:
    """The dtype `--dtype auto` takes for `gguf`: bfloat16 where any matrix is quantized (its
    Q4 / Q8_0 / Q6_K linears then stay packed and compute packed, which needs a 16-bit dtype;
    vLLM's "auto" is 16-bit for such files too), else the widest of its matrices' float types
    (F32, BF16, F16), as a safetensors config's torch_dtype."""
    kinds = {t.type_name for t in gguf.tensors.values() if len(t.shape) >= 2}
    if not kinds <= FLOAT_DTYPES.keys():
        return "bfloat16"
    return next((dtype for kind, dtype in FLOAT_DTYPES.items() if kind in kinds), "float32")


def _gemma(cfg: dict[str, Any], arch: str) -> None:
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    big = cfg.get("num_hidden_layers") == _GEMMA_27B_LAYERS[arch]
    cfg["query_pre_attn_scalar"] = (cfg["hidden_size"] // cfg["num_attention_heads"] if big
                                    else head_dim)


def generation_config(gguf: GGUFFile) -> dict[str, Any]:
    """generation_config.json's eos ids: eos plus llama.cpp's end-of-turn / end-of-message
    tokens (Llama 3's <|eot_id|>, ...)."""
    ids = [gguf.metadata.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(i for i in ids if i is not None))
    return {"eos_token_id": eos} if eos else {}
