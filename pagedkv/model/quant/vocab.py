"""A GGUF checkpoint's token embedding table and LM head kept packed, before the weights are
read: an untied head as a packed linear of either family (int8 blocks: Q8_0, Q6_K ...; 4/5-bit
groups: Q4_K, Q5_K ...), the table as an embedding of either (a lookup dequantizes its rows),
whose codes a tied model's head then computes its logits on. A Q4_K_M file of an untied model
(llama.cpp keeps token_embd in the base type) holds its table in 0.56 bytes a weight where the
bfloat16 table took 2: 0.75 GB less for a 128K x 4,096 table.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedkv.model.layers import Linear
from pagedkv.model.quant.int4_gguf import gguf_int4_linear
from pagedkv.model.quant.int4_linear import Int4Embedding, Int4Linear
from pagedkv.model.quant.int8_block_linear import Int8BlockEmbedding, Int8BlockLinear
from pagedkv.model.quant.int8_gguf import gguf_int8_block_linear

# The packed families' linear builders, tried in turn (a tensor is of one family at most).
_BUILDERS = (gguf_int8_block_linear, gguf_int4_linear)
# Each family's embedding over its linear's codes and scales.
_EMBEDDINGS = {Int8BlockLinear: Int8BlockEmbedding, Int4Linear: Int4Embedding}


def _packed(checkpoint: Any, source: str, in_features: int) -> nn.Module | None:
    """`source`'s GGUF tensor as a packed linear of the family that takes its type, or None."""
    for build in _BUILDERS:
        linear = build(checkpoint, [source], in_features)
        if linear is not None:
            return linear
    return None


def pack_gguf_vocab(model: nn.Module, checkpoint: Any) -> frozenset[str]:
    """Where the file stores them in a packed type: `model.lm_head` (an untied Linear without a
    bias) as a packed linear, and `model.embed_tokens` (a plain nn.Embedding) as an
    Int8BlockEmbedding or Int4Embedding, whose codes a tied model (`lm_head` None) then
    computes its logits on (mutates `model`). Returns the parameter names now built (empty:
    unchanged)."""
    built = set()
    head = getattr(model, "lm_head", None)
    if isinstance(head, Linear) and head.bias is None and "lm_head.weight" in checkpoint:
        packed_head = _packed(checkpoint, "lm_head.weight", head.in_features)
        if packed_head is not None:
            model.lm_head = packed_head
            built.add("lm_head.weight")
    return frozenset(built | _pack_embedding(model, checkpoint))


def _pack_embedding(model: nn.Module, checkpoint: Any) -> set[str]:
    embed = getattr(model, "embed_tokens", None)
    if type(embed) is not nn.Embedding or embed.embedding_dim % 32 \
            or "model.embed_tokens.weight" not in checkpoint:
        return set()
    table = _packed(checkpoint, "model.embed_tokens.weight", embed.embedding_dim)
    if table is None:
        return set()
    model.embed_tokens = _EMBEDDINGS[type(table)](table.codes, table.scales,
                                                  embed.weight.dtype)
    if getattr(model, "lm_head", None) is not None:
        return {"embed_tokens.weight"}
    model.lm_head = model.embed_tokens.tied_head()  # its mapping now names an lm_head
    return {"embed_tokens.weight", "lm_head.weight"}
