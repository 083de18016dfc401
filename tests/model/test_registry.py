"""The model registry: each architecture maps to its class, and a new one is a class + a line."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from pagedkv.model import registry
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.qwen2 import Qwen2ForCausalLM
from pagedkv.model.qwen3 import Qwen3ForCausalLM
from pagedkv.model.registry import model_config_from_dict
from pagedkv.model.runner import ModelRunner
from pagedkv.testing import build_random_model_dir
from tests.model.driver import prefill_logits


def test_registered_architectures_resolve_to_their_classes():
    assert registry.supported_architectures() == (
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
        "Gemma2ForCausalLM", "Gemma3ForCausalLM")
    assert registry.get_model_class("MistralForCausalLM") is LlamaForCausalLM
    assert registry.get_model_class("Gemma3ForCausalLM").__name__ == "Gemma3ForCausalLM"
    assert registry.get_model_class("Qwen2ForCausalLM") is Qwen2ForCausalLM
    assert registry.get_model_class("Qwen3ForCausalLM") is Qwen3ForCausalLM
    assert registry.resolve_architecture(["Foo", "Qwen3ForCausalLM"]) == "Qwen3ForCausalLM"
    with pytest.raises(ValueError, match=r"architecture 'GPT2LMHeadModel' is not supported"):
        registry.get_model_class("GPT2LMHeadModel")


def test_config_adapters_set_the_architecture_fields():
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
            "num_attention_heads": 4, "vocab_size": 640}
    fields = {arch: model_config_from_dict({**base, "architectures": [arch]})
              for arch in registry.supported_architectures()}
    flags = {a: (c.qkv_bias, c.o_bias, c.qk_norm) for a, c in fields.items()}
    assert flags == {"LlamaForCausalLM": (False, False, False),
                     "MistralForCausalLM": (False, False, False),
                     "Qwen2ForCausalLM": (True, False, False),
                     "Qwen3ForCausalLM": (False, False, True),
                     "Gemma2ForCausalLM": (False, False, False),
                     "Gemma3ForCausalLM": (False, False, True)}
    biased = model_config_from_dict({**base, "architectures": ["LlamaForCausalLM"],
                                    "attention_bias": True})
    assert (biased.qkv_bias, biased.o_bias) == (True, True)


class ScaledLlamaForCausalLM(LlamaForCausalLM):
    """A made-up architecture: Llama whose logits are doubled."""

    @classmethod
    def config_overrides(cls, hf_config: dict[str, Any]) -> dict[str, Any]:
        return super().config_overrides(hf_config)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return 2 * super().compute_logits(hidden)


def test_a_new_architecture_is_one_class_and_one_registry_line(tmp_path, monkeypatch):
    d = build_random_model_dir(tmp_path / "m", num_layers=2)
    llama = ModelRunner(d, block_size=4, num_blocks=32)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["ScaledLlamaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setitem(registry._MODELS, "ScaledLlamaForCausalLM",
                        (__name__, "ScaledLlamaForCausalLM"))
    scaled = ModelRunner(d, block_size=4, num_blocks=32)
    assert type(scaled.model) is ScaledLlamaForCausalLM
    prompts = [[1, 5, 9, 30, 31], [1, 7, 8]]
    torch.testing.assert_close(prefill_logits(scaled, prompts), 2 * prefill_logits(llama, prompts))
