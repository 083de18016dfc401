"""Tokenizer: a Hugging Face tokenizer.json (through `tokenizers`) plus tokenizer_config.json,
or the tokenizer a GGUF file's metadata describes (`Tokenizer.from_gguf`).

Token ids equal transformers' (v5) AutoTokenizer for the same directory: the tokenizer.json
post-processor alone decides which special tokens (bos) `encode` adds; `add_bos_token` in
tokenizer_config.json is informational (`Tokenizer.add_bos_token`), as transformers v5 treats
it for tokenizer.json-based tokenizers (checked in tests/model/test_random_model.py).
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from pagedkv.model.gguf import gguf_file
from pagedkv.model.json_files import read_json
from pagedkv.sched.validation import PromptTooLongError, check_text

# Over-long check: a text is first tokenized up to CHARS_PER_TOKEN_GUESS characters per allowed
# token; each retry takes 4x more. A cut inside a word can shift the tokens at the cut, so a
# prefix must exceed the limit by BOUNDARY_SLACK tokens before the whole text is called too long.
CHARS_PER_TOKEN_GUESS = 8
BOUNDARY_SLACK = 16


def _token_str(value: Any, name: str = "token") -> str | None:
    """A special token of tokenizer_config.json: a string, `{"content": str}` or null."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"tokenizer_config.json: {name} must be a string, got {value!r}")
    return value


class Tokenizer:
    """Encode, decode and chat-template text for one model directory."""

    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any],
                 eos_token_ids: tuple[int, ...] = (), chat_template: str | None = None) -> None:
        self._tok = tokenizer
        self.config = config
        self.bos_token = _token_str(config.get("bos_token"), "bos_token")
        self.eos_token = _token_str(config.get("eos_token"), "eos_token")
        self.pad_token = _token_str(config.get("pad_token"), "pad_token")
        self.bos_token_id = self._id_or_none(self.bos_token)
        self.eos_token_id = self._id_or_none(self.eos_token)
        self.pad_token_id = self._id_or_none(self.pad_token)
        ids = list(eos_token_ids)
        if self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.chat_template = chat_template
        added = tokenizer.get_added_tokens_decoder()
        self.all_special_ids: list[int] = sorted(i for i, t in added.items() if t.special)
        # Every added token's content, special or not (vLLM's `added_token_ids`).
        self.added_tokens: dict[int, str] = {i: t.content for i, t in added.items()}
        self._compiled_template: Any = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, generation_config.json (eos ids) and the
        chat template (tokenizer_config's `chat_template` or chat_template.jinja)."""
        gguf = gguf_file(model_dir)
        if gguf is not None:
            return cls.from_gguf(gguf)
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"missing file: {path}")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for a corrupt file
            raise ValueError(f"cannot read tokenizer {path}: {exc}") from None
        cfg_path = model_dir / "tokenizer_config.json"
        config = read_json(cfg_path) if cfg_path.is_file() else {}
        eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            p = model_dir / name
            if p.is_file():
                value = read_json(p).get("eos_token_id")
                if value is not None and not (isinstance(value, int) or (
                        isinstance(value, list) and all(isinstance(v, int) for v in value))):
                    raise ValueError(f"{p}: eos_token_id must be an integer or a list of "
                                     f"integers, got {value!r}")
                eos += [value] if isinstance(value, int) else list(value or [])
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_path = model_dir / "chat_template.jinja"
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text(encoding="utf-8")
        return cls(tok, config, tuple(eos), template)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer, special tokens, eos ids and chat template of GGUF file `path`'s
        metadata (pagedkv.model.gguf.tokenizer)."""
        from pagedkv.model.gguf.config import generation_config
        from pagedkv.model.gguf.file import open_gguf
        from pagedkv.model.gguf.tokenizer import build_tokenizer

        gguf = open_gguf(path)
        tok, config = build_tokenizer(gguf)
        eos = generation_config(gguf).get("eos_token_id", [])
        return cls(tok, config, tuple(eos), config.get("chat_template"))

    def _id_or_none(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def backend_tokenizer(self) -> HFTokenizer:
        """The underlying `tokenizers.Tokenizer` (read-only use: grammar backends read its
        vocabulary)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, bos (etc.) as the tokenizer adds them.
        ValueError when `text` is not valid Unicode (a lone surrogate)."""
        check_text(text, "text")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_bounded(self, text: str, max_tokens: int, add_special_tokens: bool = True,
                       what: str = "prompt") -> list[int]:
        """`encode(text)`, or PromptTooLongError when it has more than `max_tokens` tokens: a
        text far over is refused after tokenizing only a prefix of it (about `max_tokens`
        tokens of work, not the whole text). A text that fits is tokenized once, whole.

        Characters bound tokens neither way for every tokenizer (a byte-fallback tokenizer
        makes up to 4 tokens of one character, a BPE merge many characters into one token),
        so only tokenizing tells: growing prefixes, cut before a space where there is one.
        Releases the GIL while tokenizing (`encode_batch`), so call it from a worker thread.
        """
        check_text(text, what)
        limit = CHARS_PER_TOKEN_GUESS * max_tokens + 64
        while len(text) > limit:
            cut = text.rfind(" ", limit // 2, limit)
            prefix = text[:cut if cut > 0 else limit]
            count = len(self._encode_batch(prefix, add_special_tokens))
            if count > max_tokens + BOUNDARY_SLACK:
                raise PromptTooLongError(count - BOUNDARY_SLACK, max_tokens, what)
            limit *= 4
        ids = self._encode_batch(text, add_special_tokens)
        if len(ids) > max_tokens:
            raise PromptTooLongError(len(ids), max_tokens, what)
        return ids

    def _encode_batch(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch releases the GIL (encode does not): other threads go on meanwhile.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        """The token string of each id (None for an id outside the vocabulary)."""
        return [self._tok.id_to_token(i) for i in ids]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (special tokens left out when `skip_special_tokens`)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, context_ids: list[int], skip_special_tokens: bool = True
                      ) -> Callable[[int | list[int]], str | None]:
        """A streaming decoder primed with `context_ids` (for spacing): each call takes the next
        token id (or ids) and returns the new text, or None while a character is incomplete.
        One call into `tokenizers` per token (its `DecodeStream`); the stream holds its state."""
        stream = DecodeStream(ids=list(context_ids), skip_special_tokens=skip_special_tokens)
        return functools.partial(stream.step, self._tok)

    def use_chat_template(self, template: str) -> None:
        """Render chats with `template` (Jinja) instead of the model's own (`--chat-template`).
        Raises jinja2's TemplateError when it does not compile; the old one stays then."""
        self._compiled_template = _compile_template(template)
        self.chat_template = template

    def with_chat_template(self, template: str) -> Tokenizer:
        """A copy of this tokenizer (sharing its vocabulary) that renders chats with
        `template` (`LLM.chat(chat_template=...)`)."""
        other = copy.copy(self)
        other.use_chat_template(template)
        return other

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` with the model's jinja chat template (ValueError when it has none)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json has no "
                             "'chat_template' and there is no chat_template.jinja)")
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            pad_token=self.pad_token or "", **kwargs)


def _compile_template(template: str) -> Any:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False,
                                                                   indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)
