"""Build small random-weight Hugging Face model directories, with no network and no transformers.

`build_random_model_dir` writes config.json, model.safetensors (HF tensor names),
generation_config.json and the tokenizer files (`build_tokenizer_files`): a directory that both
transformers' `AutoModelForCausalLM` / `AutoTokenizer` and pagedkv's loader accept. The weights
are random: such a model produces fluent-looking nonsense, which is all tests, demos and
benchmarks need. Everything is deterministic in `seed`; caching a built directory is the
caller's business.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from pagedkv.config import MODEL_DTYPES
from pagedkv.model.config import torch_dtype

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
PAD_TOKEN = "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS)
TOKENIZER_VOCAB_SIZE = 640

# bos, then per message a role marker, the content and eos; the prompt ends with the assistant
# marker. The template writes bos itself (as Llama 3's does): chat prompts are encoded with
# add_special_tokens=False.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}

_CORPUS_LINES = (
    "The quick brown fox jumps over the lazy dog.",
    "A paged KV cache stores keys and values in fixed-size blocks of tokens.",
    "Each request keeps a block table that maps logical blocks to physical blocks.",
    "When memory runs out, the scheduler preempts a request by swapping or recomputing it.",
    "Prefix caching lets requests that share a system prompt reuse the same blocks.",
    "Continuous batching mixes prefill chunks and decode steps in one forward pass.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Once upon a time there was a little model that generated random text.",
    "def forward(self, input_ids, positions):\n    return self.model(input_ids, positions)",
    "for i in range(10):\n    print(i * i)",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2048 65536 3.14159",
    "Le café est très bon, n'est-ce pas? Où est la bibliothèque? Élève, été, déjà.",
    "Der Bär läuft über die Straße. Grüße aus München!",
    "中文文本测试：你好，世界。我们正在测试分页注意力。",
    "日本語のテキスト：こんにちは世界。",
    "Emoji: 😀 🚀 🎉 ❤️ 👍",
    "System: you are a helpful assistant. User: tell me a story. Assistant: sure!",
    "The attention layer writes new keys and values into their slots before it reads them.",
    "Sliding window attention lets a token see only the most recent positions.",
    "Grouped query attention shares each key and value head among several query heads.",
)


def _corpus() -> list[str]:
    """A fixed, deterministic training corpus (a few kilobytes)."""
    lines = list(_CORPUS_LINES)
    for i in range(40):
        a = _CORPUS_LINES[i % len(_CORPUS_LINES)]
        b = _CORPUS_LINES[(i * 7 + 3) % len(_CORPUS_LINES)]
        lines.append(f"{i}: {a} {b.lower()}")
    return lines


def build_tokenizer_files(model_dir: str | Path) -> Path:
    """Train a small byte-level BPE on a built-in corpus; write tokenizer.json and tokenizer_config.json.

    Byte-level, so any UTF-8 text (accents, CJK, emoji) round-trips. Special tokens: `<unk>` 0,
    `<s>` 1 (bos, added at the start by the post-processor), `</s>` 2 (eos), `<pad>` 3, then
    the chat role markers. Creates `model_dir` if needed and returns it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
            special_tokens=[(BOS_TOKEN, bos_id)],
        ),
    ])
    tok.save(str(model_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "chat_template": CHAT_TEMPLATE,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return model_dir


def tokenizer_vocab_size(model_dir: str | Path) -> int:
    """Size of the vocabulary (added tokens included) of the tokenizer.json in `model_dir`."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).get_vocab_size(True)


def hf_architecture(arch: str) -> str:
    """The config.json `architectures` name of one of our archs ("gemma2" ->
    "Gemma2ForCausalLM"); ValueError for an unknown one."""
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; supported: {sorted(_ARCHITECTURES)}")
    return _ARCHITECTURES[arch]


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def hf_config_dict(
    arch: str,
    *,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int,
    max_position_embeddings: int,
    sliding_window: int | None,
    tie_word_embeddings: bool,
    dtype: str,
    rope_scaling: dict[str, Any] | None,
    rope_theta: float = 10000.0,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
    max_window_layers: int | None = None,
    sliding_window_pattern: int | None = None,
) -> dict[str, Any]:
    """The config.json dict of one of our architectures, in Hugging Face's format.

    Qwen2/3 with a `sliding_window`: layers >= `max_window_layers` slide (default 0: all).
    Gemma 2 / Gemma 3 ("gemma2", "gemma3_text"): every `sliding_window_pattern`-th layer
    attends fully (defaults 2 and 6), the others slide over `sliding_window`; Gemma 2 with
    its soft-capping (50 on attention scores, 30 on logits)."""
    cfg: dict[str, Any] = {
        "architectures": [hf_architecture(arch)],
        "model_type": arch,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": dtype,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if rope_scaling is not None:
        cfg["rope_scaling"] = dict(rope_scaling)
    if arch == "llama":
        cfg["attention_bias"] = False
        cfg["mlp_bias"] = False
    if arch == "mistral":
        cfg["sliding_window"] = sliding_window
    if arch in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = sliding_window is not None
        cfg["sliding_window"] = sliding_window
        cfg["max_window_layers"] = (num_layers if sliding_window is None
                                    else max_window_layers or 0)
    if arch == "qwen3":
        cfg["attention_bias"] = False
    if arch in ("gemma2", "gemma3_text"):
        del cfg["hidden_act"]
        pattern = sliding_window_pattern or (2 if arch == "gemma2" else 6)
        cfg.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=head_dim,
                   attention_bias=False, sliding_window=sliding_window,
                   sliding_window_pattern=pattern,
                   layer_types=["sliding_attention" if (i + 1) % pattern else "full_attention"
                                for i in range(num_layers)])
        if arch == "gemma2":
            cfg.update(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
        else:
            cfg.update(rope_local_base_freq=10000.0, rope_theta=1_000_000.0)
    if sliding_window is not None and arch == "llama":
        raise ValueError("sliding_window is only supported for arch 'mistral', 'qwen2' or 'qwen3'")
    return cfg


def random_state_dict(cfg: dict[str, Any], *, seed: int = 0,
                      dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random weights with Hugging Face tensor names for the config dict `cfg` (std 0.02)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    vocab, std = cfg["vocab_size"], cfg["initializer_range"]

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    def norm(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(dtype)

    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab, hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm(hidden)
        sd[p + "self_attn.q_proj.weight"] = normal(heads * head_dim, hidden)
        sd[p + "self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden)
        sd[p + "self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden)
        sd[p + "self_attn.o_proj.weight"] = normal(hidden, heads * head_dim)
        if cfg["model_type"] == "qwen2":
            sd[p + "self_attn.q_proj.bias"] = normal(heads * head_dim)
            sd[p + "self_attn.k_proj.bias"] = normal(kv_heads * head_dim)
            sd[p + "self_attn.v_proj.bias"] = normal(kv_heads * head_dim)
        if cfg["model_type"] == "qwen3":
            sd[p + "self_attn.q_norm.weight"] = norm(head_dim)
            sd[p + "self_attn.k_norm.weight"] = norm(head_dim)
        sd[p + "post_attention_layernorm.weight"] = norm(hidden)
        sd[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        sd[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        sd[p + "mlp.down_proj.weight"] = normal(hidden, inter)
    sd["model.norm.weight"] = norm(hidden)
    if not cfg["tie_word_embeddings"]:
        sd["lm_head.weight"] = normal(vocab, hidden)
    return {k: v.contiguous() for k, v in sd.items()}


def build_random_model_dir(
    model_dir: str | Path,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    vocab_size: int | None = None,
    max_position_embeddings: int = 2048,
    sliding_window: int | None = None,
    tie_word_embeddings: bool = False,
    dtype: str = "float32",
    seed: int = 0,
    rope_scaling: dict[str, Any] | None = None,
) -> Path:
    """Write a random-weight HF model directory for `arch` ("llama", "qwen2", "qwen3", "mistral").

    Writes config.json, model.safetensors, generation_config.json, tokenizer.json and
    tokenizer_config.json into `model_dir` (created if needed; existing files are overwritten).
    `vocab_size` defaults to the tokenizer's size rounded up to a multiple of 64. Returns the path.
    """
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(MODEL_DTYPES)}, got {dtype!r}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    model_dir = build_tokenizer_files(model_dir)
    tok_vocab = tokenizer_vocab_size(model_dir)
    if vocab_size is None:
        vocab_size = _round_up(tok_vocab, 64)
    if vocab_size < tok_vocab:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tok_vocab}")
    if head_dim is None:
        if hidden_size % num_heads != 0:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        head_dim = hidden_size // num_heads
    cfg = hf_config_dict(
        arch, hidden_size=hidden_size, intermediate_size=intermediate_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, sliding_window=sliding_window,
        tie_word_embeddings=tie_word_embeddings, dtype=dtype, rope_scaling=rope_scaling,
    )
    sd = random_state_dict(cfg, seed=seed, dtype=torch_dtype(dtype))
    save_file(sd, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    gen_cfg = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
    (model_dir / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    return model_dir


def skew_kv_head(model_dir: str | Path, out_dir: str | Path, shrink: float = 1024.0,
                 kv_head: int = 0) -> Path:
    """Copy the model directory `model_dir` (a Llama-style one: no q/k norms) to `out_dir` with
    KV head `kv_head`'s k and v projection rows divided by `shrink` in every layer, and the q
    projection rows and o projection columns of its query heads multiplied by it: the same
    function in exact arithmetic when `shrink` is a power of two (scores and outputs unchanged),
    but KV heads whose keys and values differ `shrink`-fold in range (what per-head KV cache
    scales are for). Returns `out_dir`. Raises ValueError for a `kv_head` the model lacks."""
    out = Path(out_dir)
    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    cfg = json.loads((out / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    if not 0 <= kv_head < kv_heads:
        raise ValueError(f"kv_head must be in [0, {kv_heads}), got {kv_head!r}")
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    g = heads // kv_heads
    kv_rows = slice(kv_head * hd, (kv_head + 1) * hd)
    q_rows = slice(kv_head * g * hd, (kv_head + 1) * g * hd)
    weights = load_file(str(out / "model.safetensors"))
    for name, w in weights.items():
        w = w.clone()
        if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight",
                          "self_attn.k_proj.bias", "self_attn.v_proj.bias")):
            w[kv_rows] /= shrink
        elif name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            w[q_rows] *= shrink
        elif name.endswith("self_attn.o_proj.weight"):
            w[:, q_rows] *= shrink
        weights[name] = w
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
