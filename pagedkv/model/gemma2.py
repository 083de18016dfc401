"""Gemma 2 on paged KV (and the base of Gemma 3, gemma3.py).

What differs from Llama: RMSNorm scales by (1 + weight), in float32; four norms per layer (before
and after attention, before and after the MLP, the "after" ones applied to the branch before
the residual add); the embeddings are scaled by sqrt(hidden_size) (rounded to the weights'
dtype); a tanh-approximated GELU gates the MLP; attention scale `query_pre_attn_scalar ** -0.5`;
attention scores and final logits soft-capped (`cap * tanh(x / cap)`); sliding-window and full
layers alternate (`layer_types`, or every second layer full), so the KV cache has a group of
each (kv/hybrid_spec.py).

Tensor parallel (a `TensorParallelGroup`): Megatron sharding as in llama.py (parallel/
sharding.py). The all-reduces come before the "after" norms, which need the whole sum; the
final soft-cap is applied on rank 0 to the gathered logits.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pagedkv.model.attention import AttentionMetadata
from pagedkv.model.config import ModelConfig
from pagedkv.model.kv_int8 import PerTokenScales
from pagedkv.model.kv_quant import KVScales
from pagedkv.model.layers import Linear, RotaryEmbedding
from pagedkv.model.ops import LayerOps, RopeInputs
from pagedkv.model.parallel.group import TensorParallelGroup
from pagedkv.model.parallel.sharding import (
    Shard,
    TensorParallelShape,
    checkpoint_shards,
    model_shard,
)
from pagedkv.model.parallel.vocab import gather_vocab_logits, vocab_embedding
from pagedkv.model.softcap_attention import SoftcappedMetadata


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), computed in float32 and cast back (transformers' Gemma)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GemmaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None, qk_norm: bool,
                 shard: TensorParallelShape | None = None) -> None:
        """`shard`: this rank's heads only (None: all of them)."""
        super().__init__()
        raw = cfg.hf_config.raw if cfg.hf_config is not None else {}
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if shard is not None:
            self.num_heads, self.num_kv_heads = shard.local_heads, shard.local_kv_heads
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.window = window
        self.scale = float(raw.get("query_pre_attn_scalar", cfg.head_dim)) ** -0.5
        cap = raw.get("attn_logit_softcapping")
        self.softcap = None if cap is None else float(cap)
        # fp8: per-tensor KVScales; int8: the layer's PerTokenScales; set by the runner.
        self.kv_scales: KVScales | PerTokenScales | None = None

    def forward(self, x: torch.Tensor, rope: RopeInputs, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, ops: LayerOps) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).view(t, self.num_heads + 2 * self.num_kv_heads,
                                        self.head_dim).split(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rope(q.contiguous(), rope), ops.rope(k.contiguous(), rope)
        if self.softcap is not None:  # any cache format (softcap_attention.py)
            meta = SoftcappedMetadata(meta, self.softcap)
        if self.kv_scales is None:
            out = meta.attend(q, k, v, kv_cache[0], kv_cache[1], self.scale, self.window)
        else:  # fp8: scales folded in; int8: its scale caches passed on
            out = self.kv_scales.attend(meta, q, k, v, kv_cache[0], kv_cache[1], self.scale,
                                        self.window)
        return self.o_proj(out.reshape(t, self.q_size))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None, qk_norm: bool,
                 tp: TensorParallelGroup | None = None,
                 shard: TensorParallelShape | None = None) -> None:
        """With `tp`, the layer holds `shard` and all-reduces attention's and the MLP's
        row-parallel outputs before their "after" norms."""
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = GemmaAttention(cfg, window, qk_norm, shard)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = GemmaMLP(cfg.hidden_size, cfg.intermediate_size if shard is None
                            else shard.local_intermediate)
        self.tp = tp

    def forward(self, x: torch.Tensor, rope: RopeInputs, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, ops: LayerOps) -> torch.Tensor:
        h = self.self_attn.forward(self.input_layernorm(x), rope, kv_cache, meta, ops)
        if self.tp is not None:
            h = self.tp.all_reduce(h)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.tp is not None:
            h = self.tp.all_reduce(h)
        return x + self.post_feedforward_layernorm(h)


class Gemma2ForCausalLM(nn.Module):
    """Gemma 2 (see module docstring); Gemma3ForCausalLM adds q/k norms and a local RoPE."""

    qk_norm = False
    hidden_activations: tuple[str, ...] = ("gelu_pytorch_tanh",)  # GemmaMLP's tanh GELU

    @classmethod
    def config_overrides(cls, hf_config: dict[str, Any]) -> dict[str, Any]:
        bias = bool(hf_config.get("attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": cls.qk_norm}

    def __init__(self, cfg: ModelConfig, tp: TensorParallelGroup | None = None) -> None:
        """The whole model, or with `tp` (size > 1) rank `tp.rank`'s shard of it."""
        super().__init__()
        self.config = cfg
        raw = cfg.hf_config.raw if cfg.hf_config is not None else {}
        self.shard = model_shard(tp, cfg)
        self.tp = None if self.shard is None else tp
        self.embed_tokens = vocab_embedding(cfg.vocab_size, cfg.hidden_size, self.tp, self.shard)
        self.embed_scale = math.sqrt(cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, w, self.qk_norm, self.tp, self.shard)
                                    for w in cfg.layer_sliding_windows)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                      cfg.max_position_embeddings)
        vocab = cfg.vocab_size if self.shard is None else self.shard.local_vocab
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, vocab, bias=False)
        cap = raw.get("final_logit_softcapping")
        self.final_softcap = None if cap is None else float(cap)
        self.ops = LayerOps()

    @property
    def attention_reads_kv_cache(self) -> bool:
        """Whether every layer attends through softcap_attention.py, which stores and reads
        the KV cache itself in any format (its dtype, fp8, int8 with its scales): the runner
        then gives the layers the backend's own metadata, never QuantizedKVBackend's. The cap
        is one config value for all layers."""
        return self.layers[0].self_attn.softcap is not None

    def layer_rope(self, positions: torch.Tensor, dtype: torch.dtype) -> list[RopeInputs]:
        """Each layer's RoPE inputs (Gemma 2: one RoPE for all)."""
        rope = self.rotary.inputs(positions, dtype)
        return [rope] * len(self.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor:
        """Final hidden states [T, hidden]; writes every layer's new K/V into `kv_caches`.
        `meta`: the step's metadata, or each layer's (KV cache groups)."""
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        metas = meta if isinstance(meta, list) else [meta] * len(self.layers)
        ropes = self.layer_rope(positions, x.dtype)
        for layer, kv_cache, m, rope in zip(self.layers, kv_caches, metas, ropes, strict=True):
            x = layer.forward(x, rope, kv_cache, m, self.ops)
        return self.norm(x)

    def pack_linear_weights(self, panels: bool = False) -> int:
        return sum(m.pack(panels) for m in self.modules() if isinstance(m, Linear))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [N, vocab], soft-capped when the config says so. Tensor parallel:
        gathered on rank 0 (None on the others), as in LlamaForCausalLM."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden).float()
        else:
            logits = (hidden @ self.embed_tokens.weight.t()).float()
        logits = gather_vocab_logits(logits, self.tp, self.config.vocab_size)
        if logits is not None and self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def checkpoint_mapping(self) -> dict[str, list[str]]:
        """Parameter name -> Hugging Face tensor names it is the dim-0 concatenation of."""
        cfg = self.config
        m: dict[str, list[str]] = {"embed_tokens.weight": ["model.embed_tokens.weight"],
                                   "norm.weight": ["model.norm.weight"]}
        if self.lm_head is not None:
            m["lm_head.weight"] = ["lm_head.weight"]
        norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm")
        for i in range(cfg.num_layers):
            p, hf = f"layers.{i}.", f"model.layers.{i}."
            for norm in norms:
                m[p + norm + ".weight"] = [hf + norm + ".weight"]
            for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
                m[p + f"self_attn.qkv_proj.{kind}"] = [
                    hf + f"self_attn.{n}_proj.{kind}" for n in ("q", "k", "v")]
            for kind in ("weight", "bias") if cfg.o_bias else ("weight",):
                m[p + f"self_attn.o_proj.{kind}"] = [hf + f"self_attn.o_proj.{kind}"]
            if self.qk_norm:
                m[p + "self_attn.q_norm.weight"] = [hf + "self_attn.q_norm.weight"]
                m[p + "self_attn.k_norm.weight"] = [hf + "self_attn.k_norm.weight"]
            m[p + "mlp.gate_up_proj.weight"] = [hf + "mlp.gate_proj.weight",
                                                hf + "mlp.up_proj.weight"]
            m[p + "mlp.down_proj.weight"] = [hf + "mlp.down_proj.weight"]
        return m

    def checkpoint_splits(self, param_name: str) -> list[int]:
        """Dim-0 sizes of the tensors a fused parameter concatenates (this rank's share)."""
        attn = self.layers[0].self_attn
        if "qkv_proj" in param_name:
            return [attn.q_size, attn.kv_size, attn.kv_size]
        if "gate_up_proj" in param_name:
            return [self.layers[0].mlp.intermediate] * 2
        raise ValueError(f"{param_name} is not a fused parameter")

    def checkpoint_shards(self, param_name: str) -> list[Shard | None] | None:
        """Which slice of each of `param_name`'s checkpoint tensors this rank loads (None for
        the whole model: no tensor parallelism)."""
        return checkpoint_shards(param_name, self.shard, self.config)
