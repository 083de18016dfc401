"""The tokenizer a GGUF file describes, built as a `tokenizers.Tokenizer`.

A GGUF carries no tokenizer.json: its metadata holds the vocabulary (`tokenizer.ggml.tokens`),
the BPE merges, each token's type (3: control, 4: user-defined), the special token ids, whether
to add BOS, and the chat template. Two kinds are built, as transformers' GGUF loader builds them:

- "gpt2": byte-level BPE (SmolLM, Qwen, Llama 3, ...), with the split regex llama.cpp uses for
  the file's `tokenizer.ggml.pre`;
- "llama": SentencePiece BPE with byte fallback (Llama 2, Mistral, TinyLlama, ...), merges
  taken from the file or rebuilt from the token scores when it has none.

Control tokens become special added tokens, user-defined ones plain added tokens (both matched
whole); BOS is prepended by the post-processor when the file says so.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from pagedkv.model.gguf.file import GGUFFile

CONTROL, USER_DEFINED = 3, 4

# tokenizer.ggml.pre -> llama.cpp's split regex (llama-vocab.cpp), where it is not GPT-2's.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3,
           "dbrx": _LLAMA3, "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2}
# Pre-tokenizers that split every digit off first, then split as GPT-2 ("smollm": \p{N}).
_DIGIT_FIRST = frozenset({"smollm"})


def build_tokenizer(gguf: GGUFFile) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer and its tokenizer_config.json dict (special tokens, add_bos_token,
    chat_template). ValueError naming a tokenizer kind that is not built here."""
    meta = gguf.metadata
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError(f"GGUF file {gguf.path} has no tokenizer (tokenizer.ggml.tokens)")
    if kind == "gpt2":
        tok = _byte_level(tokens, meta)
        add_bos_default = False
    elif kind == "llama" and gguf.architecture not in ("gemma2", "gemma3"):
        tok = _sentencepiece(tokens, meta)
        add_bos_default = True  # llama.cpp's default for SentencePiece vocabularies
    else:
        raise ValueError(f"GGUF tokenizer {kind!r} ({gguf.architecture}) of {gguf.path} is not "
                         "supported; supported: 'gpt2' (byte-level BPE) and 'llama' "
                         "(SentencePiece BPE, not Gemma's); give the model's Hugging Face "
                         "tokenizer directory as `tokenizer` (--tokenizer DIR)")
    _add_special(tok, tokens, meta.get("tokenizer.ggml.token_type") or [])
    config = _tokenizer_config(tokens, meta, add_bos_default)
    if config["add_bos_token"] and config.get("bos_token") is not None:
        bos = config["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, tokens.index(bos))])
    return tok, config


def _byte_level(tokens: list[str], meta: dict[str, Any]) -> Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                        fuse_unk=False, continuing_subword_prefix="", end_of_word_suffix=""))
    pre = meta.get("tokenizer.ggml.pre")
    if pre in _SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in _DIGIT_FIRST:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(tokens: list[str], meta: dict[str, Any]) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = ([tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
              if meta.get("tokenizer.ggml.merges")
              else _merges_from_scores(vocab, meta.get("tokenizer.ggml.scores") or []))
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                        unk_token=None if unk is None else tokens[unk]))
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _merges_from_scores(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece merges recovered from the vocabulary: every split of a token into two
    tokens, best-scored token first (transformers' `generate_merges`)."""
    found = []
    for token, index in vocab.items():
        score = scores[index] if index < len(scores) else 0.0
        pairs = [(token[:i], token[i:]) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        found += [(left, right, score) for left, right in pairs]
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_special(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    control = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, types, strict=False) if kind == CONTROL]
    user = [AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types, strict=False) if kind == USER_DEFINED]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)


def _tokenizer_config(tokens: list[str], meta: dict[str, Any],
                      add_bos_default: bool) -> dict[str, Any]:
    def token(name: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{name}_token_id")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    config: dict[str, Any] = {
        "bos_token": token("bos"), "eos_token": token("eos"), "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    }
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return config
