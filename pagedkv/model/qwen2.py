"""Qwen2: the Llama layers with biases on the q/k/v projections (never on o_proj)."""

from __future__ import annotations

from typing import Any

from pagedkv.model.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def config_overrides(cls, hf_config: dict[str, Any]) -> dict[str, Any]:
        return {**super().config_overrides(hf_config), "qkv_bias": True, "o_bias": False}
