"""The Llama family on paged KV: Llama and Mistral here; Qwen2 and Qwen3 subclass it.

The forward pass takes the flattened tokens of a whole mixed batch (no padding): input_ids [T],
positions [T] and the step's AttentionMetadata; each layer writes its new K/V into the paged
cache and attends through the block tables. Logits are computed only for the hidden states
the caller selects (`compute_logits`). q/k/v and gate/up projections are fused into one matmul
each; `checkpoint_mapping` says which Hugging Face tensors each parameter is built from.

Built with a `TensorParallelGroup` the model holds one rank's shard (parallel/sharding.py):
its attention heads and KV heads, its slice of the MLP and of the vocabulary, one all-reduce
after attention and one after the MLP; `checkpoint_shards` says which slice of each Hugging
Face tensor the rank loads, and `compute_logits` gathers the full logits on rank 0 only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedkv.model.attention import AttentionMetadata
from pagedkv.model.config import ModelConfig
from pagedkv.model.decode_stack import DecodeStack
from pagedkv.model.kv_int8 import PerTokenScales
from pagedkv.model.kv_quant import KVScales
from pagedkv.model.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding
from pagedkv.model.ops import LayerOps, RopeInputs
from pagedkv.model.parallel.group import TensorParallelGroup
from pagedkv.model.parallel.sharding import (
    Shard,
    TensorParallelShape,
    checkpoint_shards,
    model_shard,
)
from pagedkv.model.parallel.vocab import gather_vocab_logits, vocab_embedding


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None,
                 shard: TensorParallelShape | None = None) -> None:
        """`shard`: this rank's heads only (None: all of them)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if shard is not None:
            self.num_heads, self.num_kv_heads = shard.local_heads, shard.local_kv_heads
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.window = window
        self.scale = cfg.head_dim ** -0.5
        # fp8: per-tensor KVScales; int8: the layer's PerTokenScales; set by the runner.
        self.kv_scales: KVScales | PerTokenScales | None = None

    def forward(self, x: torch.Tensor, rope: RopeInputs, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, ops: LayerOps) -> torch.Tensor:
        t = x.shape[0]
        # .forward on the projections, as on the layers: no hook machinery per call at decode.
        qkv = self.qkv_proj.forward(x).view(t, self.num_heads + 2 * self.num_kv_heads,
                                            self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None:
            q, k = ops.rope(self.q_norm(q), rope), ops.rope(self.k_norm(k), rope)
        else:  # one RoPE call for q and k together (views of one [T, heads + kv_heads, D] tensor)
            qk = qkv[:, : self.num_heads + self.num_kv_heads]
            rotated = ops.rope(qk, rope)
            if rotated is not qk:  # a new tensor (else q and k, views of qk, rotated in place)
                q, k = rotated.split([self.num_heads, self.num_kv_heads], dim=1)
        if self.kv_scales is None:
            out = meta.attend(q, k, v, kv_cache[0], kv_cache[1], self.scale, self.window)
        else:  # fp8: per-tensor scales folded in; int8: the per-token scale caches passed on
            out = self.kv_scales.attend(meta, q, k, v, kv_cache[0], kv_cache[1], self.scale,
                                        self.window)
        return self.o_proj.forward(out.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None,
                 tp: TensorParallelGroup | None = None,
                 shard: TensorParallelShape | None = None) -> None:
        """With `tp`, the layer holds `shard` and all-reduces attention's and the MLP's
        row-parallel outputs (each rank's partial sums)."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, window, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size if shard is None
                            else shard.local_intermediate, cfg.mlp_bias)
        self.tp = tp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeInputs,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream): the residual stream `residual`
        (None for the first layer: it is `x`) gets the previous layer's output `x` added in
        place before this layer's input norm, and this layer's attention output after it."""
        norm = self.input_layernorm
        if residual is None:
            residual, h = x, ops.rms_norm(x, norm.weight, norm.eps)
        else:
            h = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        # .forward: skips nn.Module's hook machinery, a measurable cost per tiny op at decode.
        attn = self.self_attn.forward(h, rope, kv_cache, meta, ops)
        if self.tp is not None:
            attn = self.tp.all_reduce(attn)
        norm = self.post_attention_layernorm
        h = ops.add_rms_norm(attn, residual, norm.weight, norm.eps)
        out = self.mlp.forward(h, ops)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        return out, residual


class LlamaForCausalLM(nn.Module):
    """Llama and Mistral, and the base of Qwen2/Qwen3: their variations are ModelConfig fields
    (biases, q/k norm, per-layer windows) that each class's `config_overrides` sets."""

    hidden_activations: tuple[str, ...] = ("silu",)  # config.json activations it runs

    @classmethod
    def config_overrides(cls, hf_config: dict[str, Any]) -> dict[str, Any]:
        """The architecture-specific ModelConfig fields read from the config.json dict (the
        config adapter; see pagedkv.model.registry). Llama: `attention_bias` on every
        attention projection, no q/k norm."""
        bias = bool(hf_config.get("attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}

    def __init__(self, cfg: ModelConfig, tp: TensorParallelGroup | None = None) -> None:
        """The whole model, or with `tp` (size > 1) rank `tp.rank`'s shard of it."""
        super().__init__()
        self.config = cfg
        self.shard = model_shard(tp, cfg)
        self.tp = None if self.shard is None else tp
        self.embed_tokens = vocab_embedding(cfg.vocab_size, cfg.hidden_size, self.tp, self.shard)
        self.layers = nn.ModuleList(DecoderLayer(cfg, w, self.tp, self.shard)
                                    for w in cfg.layer_sliding_windows)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                      cfg.max_position_embeddings)
        vocab = cfg.vocab_size if self.shard is None else self.shard.local_vocab
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, vocab, bias=False)
        self.ops = LayerOps()  # which elementwise kernels run (the runner sets cpu_fused)
        self.decode_stack: DecodeStack | None = None  # set by pack_linear_weights(panels=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor:
        """Final hidden states [T, hidden]; writes every layer's new K/V into `kv_caches`.
        `meta`: the step's metadata, or each layer's (KV cache groups)."""
        if self.decode_stack is not None and self.ops.cpu_fused:  # decodes: one C++ call
            hidden = self.decode_stack.run(self, input_ids, positions, kv_caches, meta)
            if hidden is not None:
                return hidden
        x = self.embed_tokens(input_ids)
        rope = self.rotary.inputs(positions, x.dtype)
        residual = None
        if isinstance(meta, list):  # KV cache groups: each layer's own (model/kv_groups.py)
            for layer, kv_cache, m in zip(self.layers, kv_caches, meta, strict=True):
                x, residual = layer.forward(x, residual, rope, kv_cache, m, self.ops)
            return self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer.forward(x, residual, rope, kv_cache, meta, self.ops)
        return self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)

    def pack_linear_weights(self, panels: bool = False) -> int:
        """Pre-pack every layer's projection weights for the CPU where that is faster (see
        layers.Linear; call after loading weights; `panels` once the fused CPU kernels are
        loaded; which also gives the model its DecodeStack where `_stack_fits`).
        Returns how many were packed."""
        packed = sum(m.pack(panels) for m in self.modules() if isinstance(m, Linear))
        self.decode_stack = DecodeStack() if panels and self._stack_fits() else None
        return packed

    def _stack_fits(self) -> bool:
        """Whether this model's structure allows a DecodeStack (decode_stack.py; the per-step
        conditions are checked there): these classes' layers as they are, whole on one
        process, without q/k norm."""
        if self.tp is not None or len(self.layers) == 0:
            return False
        return all(type(layer) is DecoderLayer and type(layer.self_attn) is Attention
                   and type(layer.mlp) is GatedMLP and layer.self_attn.q_norm is None
                   and layer.tp is None for layer in self.layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [N, vocab] for hidden states [N, hidden]. Tensor parallel: every rank
        computes its vocabulary slice and rank 0 gathers them (the others get None), so one
        sampler with one set of generators samples, as with one process."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden).float()
        else:
            logits = (hidden @ self.embed_tokens.weight.t()).float()
        return gather_vocab_logits(logits, self.tp, self.config.vocab_size)

    def checkpoint_mapping(self) -> dict[str, list[str]]:
        """Parameter name -> Hugging Face tensor names it is the dim-0 concatenation of."""
        cfg = self.config
        m: dict[str, list[str]] = {"embed_tokens.weight": ["model.embed_tokens.weight"],
                                   "norm.weight": ["model.norm.weight"]}
        if self.lm_head is not None:
            m["lm_head.weight"] = ["lm_head.weight"]
        for i in range(cfg.num_layers):
            p, hf = f"layers.{i}.", f"model.layers.{i}."
            m[p + "input_layernorm.weight"] = [hf + "input_layernorm.weight"]
            m[p + "post_attention_layernorm.weight"] = [hf + "post_attention_layernorm.weight"]
            for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
                m[p + f"self_attn.qkv_proj.{kind}"] = [
                    hf + f"self_attn.{n}_proj.{kind}" for n in ("q", "k", "v")]
            for kind in ("weight", "bias") if cfg.o_bias else ("weight",):
                m[p + f"self_attn.o_proj.{kind}"] = [hf + f"self_attn.o_proj.{kind}"]
            if cfg.qk_norm:
                m[p + "self_attn.q_norm.weight"] = [hf + "self_attn.q_norm.weight"]
                m[p + "self_attn.k_norm.weight"] = [hf + "self_attn.k_norm.weight"]
            for kind in ("weight", "bias") if cfg.mlp_bias else ("weight",):
                m[p + f"mlp.gate_up_proj.{kind}"] = [hf + f"mlp.gate_proj.{kind}",
                                                      hf + f"mlp.up_proj.{kind}"]
                m[p + f"mlp.down_proj.{kind}"] = [hf + f"mlp.down_proj.{kind}"]
        return m

    def checkpoint_splits(self, param_name: str) -> list[int]:
        """Dim-0 sizes of the tensors a fused parameter concatenates (this rank's share)."""
        cfg = self.config
        attn = self.layers[0].self_attn if len(self.layers) else None
        if "qkv_proj" in param_name:
            return [attn.q_size, attn.kv_size, attn.kv_size]
        if "gate_up_proj" in param_name:
            return [self.layers[0].mlp.intermediate] * 2
        raise ValueError(f"{param_name} is not a fused parameter ({cfg.architecture})")

    def checkpoint_shards(self, param_name: str) -> list[Shard | None] | None:
        """Which slice of each of `param_name`'s checkpoint tensors this rank loads (None: the
        whole tensor); None for the whole model (no tensor parallelism)."""
        return checkpoint_shards(param_name, self.shard, self.config)
