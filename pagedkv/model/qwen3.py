"""Qwen3: the Llama layers with an RMSNorm on each head's query and key (before RoPE)."""

from __future__ import annotations

from typing import Any

from pagedkv.model.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def config_overrides(cls, hf_config: dict[str, Any]) -> dict[str, Any]:
        return {**super().config_overrides(hf_config), "qk_norm": True}
