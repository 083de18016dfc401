"""Write a Hugging Face model directory as a GGUF file, the way llama.cpp's converter does:
its names, its q/k row permutation (Llama, Mistral), Gemma's norms stored plus one, the byte-level
BPE tokenizer as metadata. Tests load both and compare: any mapping slip changes the tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants
from safetensors.torch import load_file

# config.json model_type -> GGUF architecture.
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "gemma2": "gemma2", "gemma3_text": "gemma3"}
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
          "post_attention_layernorm": "ffn_norm"}
_GEMMA_LAYER = {**_LAYER, "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str, gemma: bool) -> str | None:
    if hf in _TOP:
        return _TOP[hf]
    parts = hf.split(".")  # model.layers.N.<module...>.weight
    module, kind = ".".join(parts[3:-1]), parts[-1]
    table = _GEMMA_LAYER if gemma else _LAYER
    return f"blk.{parts[2]}.{table[module]}.{kind}" if module in table else None


def write_gguf(model_dir: Path, out: Path, *, quant: GGMLQuantizationType | None = None,
               arch: str | None = None, rope_freqs: np.ndarray | None = None,
               types: dict[str, GGMLQuantizationType] | None = None) -> Path:
    """`model_dir` (a tiny float32 model) as GGUF file `out`; 2-D weights in `quant` when given
    (F32 otherwise), those of a kind in `types` (GGUF's name: "attn_v") in its type there, as a
    llama.cpp mix (Q4_K_M: attn_v in Q6_K); `arch` overrides the architecture name (to test
    refusals)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    gguf_arch = arch or GGUF_ARCH[cfg["model_type"]]
    gemma = gguf_arch in ("gemma2", "gemma3")
    writer = GGUFWriter(out, gguf_arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    writer.add_vocab_size(cfg["vocab_size"])
    if cfg.get("sliding_window") and gemma:
        writer.add_sliding_window(cfg["sliding_window"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            getattr(writer, f"add_{key}")(cfg[key])
    _write_tokenizer(writer, model_dir, cfg)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for hf, tensor in load_file(model_dir / "model.safetensors").items():
        name = gguf_name(hf, gemma)
        if name is None:
            continue
        w = tensor.float().numpy()
        if gguf_arch == "llama" and ".attn_q." in name:
            w = _permute(w, heads)
        elif gguf_arch == "llama" and ".attn_k." in name:
            w = _permute(w, kv_heads)
        elif gemma and name.endswith("norm.weight"):
            w = w + 1.0
        kind = (types or {}).get(name.split(".")[-2], quant)
        k_quant = {GGMLQuantizationType.Q3_K: quantize_q3_k, GGMLQuantizationType.Q4_K:
                   quantize_q4_k, GGMLQuantizationType.Q5_K: quantize_q5_k,
                   GGMLQuantizationType.Q6_K: quantize_q6_k}.get(kind)
        if k_quant is not None and w.ndim == 2 and w.shape[1] % 256 == 0:
            writer.add_tensor(name, k_quant(w), raw_dtype=kind)
        elif k_quant is not None and w.ndim == 2:  # rows off 256: as llama.cpp
            writer.add_tensor(name, quants.quantize(w, GGMLQuantizationType.Q8_0),
                              raw_dtype=GGMLQuantizationType.Q8_0)
        elif kind is not None and w.ndim == 2:
            writer.add_tensor(name, quants.quantize(w, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def quantize_q4_k(w: np.ndarray, bits: int = 4) -> np.ndarray:
    """Rows `w` [n, k] (k a multiple of 256) as Q4_K super-blocks [n, k / 256 * 144] (the gguf
    package has no Q4_K quantizer): per 32 weights a 6-bit scale and min times the
    super-block's fp16 d and dmin, codes 0..15 (a plain rounding, not llama.cpp's search);
    `bits` 5: as Q5_K super-blocks [n, k / 256 * 176], codes 0..31, their fifth bits in qh
    (byte l's bit c: code l of sub-block c) before the nibbles."""
    n, k = w.shape
    top = (1 << bits) - 1
    sub = w.reshape(-1, 8, 32).astype(np.float64)  # [super-blocks, 8, 32]
    low = np.minimum(sub.min(axis=2), 0.0)
    scale = (sub.max(axis=2) - low) / top
    d = np.maximum(scale.max(axis=1), 1e-8) / 63
    dmin = np.maximum(-low.min(axis=1), 1e-8) / 63
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    sc = np.clip(np.rint(scale / d16.astype(np.float64)[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.rint(-low / dmin16.astype(np.float64)[:, None]), 0, 63).astype(np.uint8)
    step = d16.astype(np.float64)[:, None] * sc
    offset = dmin16.astype(np.float64)[:, None] * mn
    q = np.clip(np.rint((sub + offset[..., None]) / step[..., None]), 0, top).astype(np.uint8)
    packed = np.empty((sub.shape[0], 12), np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    chunks = q.reshape(-1, 4, 2, 32) & 15  # 4 chunks of 64 codes: byte j holds j and j + 32
    qs = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(-1, 128)
    qh = np.zeros((q.shape[0], 0), np.uint8)
    if bits == 5:
        fifth = (q >> 4).astype(np.uint8)  # [super-blocks, 8 sub-blocks, 32]
        qh = np.bitwise_or.reduce(fifth << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    blocks = np.concatenate((d16.view(np.uint8).reshape(-1, 2),
                             dmin16.view(np.uint8).reshape(-1, 2), packed, qh, qs), axis=1)
    return blocks.reshape(n, -1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """`quantize_q4_k` in 5 bits: Q5_K super-blocks."""
    return quantize_q4_k(w, bits=5)


def quantize_q3_k(w: np.ndarray) -> np.ndarray:
    """Rows `w` [n, k] (k a multiple of 256) as Q3_K super-blocks [n, k / 256 * 110] (the gguf
    package has no Q3_K quantizer): per 16 weights a 6-bit scale (stored plus 32) times the
    super-block's fp16 d, codes -4..3 stored plus 4 as a low pair (qs: byte l of each 32
    holds the pairs of codes l, l + 32, l + 64, l + 96 of its half) and a high bit (hmask: byte
    l's bit j, code 32 j + l), ggml's layout (a plain rounding, not llama.cpp's search)."""
    n, k = w.shape
    sub = w.reshape(-1, 16, 16).astype(np.float64)  # [super-blocks, 16 blocks, 16]
    scale = np.abs(sub).max(axis=2) / 4
    d16 = (np.maximum(scale.max(axis=1), 1e-8) / 31).astype(np.float16)
    sc = np.clip(np.rint(scale / d16.astype(np.float64)[:, None]), 1, 31).astype(np.uint8) + 32
    step = d16.astype(np.float64)[:, None] * (sc.astype(np.float64) - 32)
    u = (np.clip(np.rint(sub / step[..., None]), -4, 3) + 4).astype(np.uint8).reshape(-1, 256)
    halves = (u & 3).reshape(-1, 2, 4, 32)  # [sb, half of 128, shift j, l]
    qs = np.bitwise_or.reduce(halves << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None],
                              axis=2).reshape(-1, 64)
    high = (u >> 2).reshape(-1, 8, 32)  # [sb, 32-code run j, l]
    hmask = np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    low4 = sc & 15
    top = sc >> 4  # two bits each
    packed = np.empty((sc.shape[0], 12), np.uint8)
    packed[:, 0:8] = low4[:, :8] | (low4[:, 8:] << 4)
    packed[:, 8:12] = top[:, 0:4] | (top[:, 4:8] << 2) | (top[:, 8:12] << 4) | (top[:, 12:] << 6)
    blocks = np.concatenate((hmask, qs, packed, d16.view(np.uint8).reshape(-1, 2)), axis=1)
    return blocks.reshape(n, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """Rows `w` [n, k] (k a multiple of 256) as Q6_K super-blocks [n, k / 256 * 210] (the gguf
    package has no Q6_K quantizer): per 16 weights an int8 scale times the super-block's fp16
    d, codes -32..31 stored plus 32 as 4 low bits (ql) and 2 high (qh), ggml's layout (a plain
    rounding, not llama.cpp's search)."""
    n, k = w.shape
    sub = w.reshape(-1, 16, 16).astype(np.float64)  # [super-blocks, 16 blocks, 16]
    scale = np.abs(sub).max(axis=2) / 31
    d16 = (np.maximum(scale.max(axis=1), 1e-8) / 127).astype(np.float16)
    sc = np.clip(np.rint(scale / d16.astype(np.float64)[:, None]), 1, 127).astype(np.int8)
    step = d16.astype(np.float64)[:, None] * sc
    q = (np.clip(np.rint(sub / step[..., None]), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # two halves of 128: four runs of 32 (l, l + 32, + 64, + 96)
    ql = np.concatenate((q[:, :, 0] & 15 | (q[:, :, 2] & 15) << 4,
                         q[:, :, 1] & 15 | (q[:, :, 3] & 15) << 4), axis=2)  # [sb, 2, 64]
    qh = q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    blocks = np.concatenate((ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8),
                             d16.view(np.uint8).reshape(-1, 2)), axis=1)
    return blocks.reshape(n, -1)


def _write_tokenizer(writer: GGUFWriter, model_dir: Path, cfg: dict) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {}
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        special[added["id"]] = added.get("special", False)
    tokens = [""] * cfg["vocab_size"]
    types = [1] * cfg["vocab_size"]  # 1: normal
    for token, index in vocab.items():
        if index < len(tokens):
            tokens[index] = token
            types[index] = 3 if special.get(index) else 1
    for i, token in enumerate(tokens):  # padding ids past the tokenizer's: unused
        if not token:
            tokens[i], types[i] = f"<unused{i}>", 5
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    writer.add_add_bos_token(bool(tok_config.get("add_bos_token")))
    if tok_config.get("chat_template"):
        writer.add_chat_template(tok_config["chat_template"])
    gen = json.loads((model_dir / "generation_config.json").read_text())
    if cfg.get("bos_token_id") is not None:
        writer.add_bos_token_id(cfg["bos_token_id"])
    eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    if eos is not None:
        writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
