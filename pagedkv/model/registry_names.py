"""The model registry's names, without torch: config.json's `architectures` name -> the module
and class that run it (`registry.py` imports them on first use). Plain data, so the command
line can refuse an architecture it does not run before torch loads."""

from __future__ import annotations

# architecture (config.json "architectures") -> (module, class)
MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("pagedkv.model.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("pagedkv.model.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("pagedkv.model.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("pagedkv.model.qwen3", "Qwen3ForCausalLM"),
    "Gemma2ForCausalLM": ("pagedkv.model.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("pagedkv.model.gemma3", "Gemma3ForCausalLM"),
}


def resolve_architecture(architectures: list[str] | tuple[str, ...]) -> str:
    """The first of config.json's `architectures` that is registered; ValueError naming them
    and the supported ones otherwise."""
    arch = next((a for a in architectures if a in MODELS), None)
    if arch is None:
        named = ", ".join(map(repr, architectures)) if architectures else "(none named)"
        raise ValueError(f"architecture {named} is not supported; "
                         f"supported: {', '.join(MODELS)}")
    return arch
