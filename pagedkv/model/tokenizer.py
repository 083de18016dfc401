"""Tokenizer: a Hugging Face tokenizer.json (through `tokenizers`) plus tokenizer_config.json.

Token ids equal transformers' (v5) AutoTokenizer for the same directory: the tokenizer.json
post-processor alone decides which special tokens (bos) `encode` adds; `add_bos_token` in
tokenizer_config.json is informational (`Tokenizer.add_bos_token`), as transformers v5 treats
it for tokenizer.json-based tokenizers (checked in tests/model/test_random_model.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Encode, decode and chat-template text for one model directory."""

    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any],
                 eos_token_ids: tuple[int, ...] = (), chat_template: str | None = None) -> None:
        self._tok = tokenizer
        self.config = config
        self.bos_token = _token_str(config.get("bos_token"))
        self.eos_token = _token_str(config.get("eos_token"))
        self.pad_token = _token_str(config.get("pad_token"))
        self.bos_token_id = self._id_or_none(self.bos_token)
        self.eos_token_id = self._id_or_none(self.eos_token)
        self.pad_token_id = self._id_or_none(self.pad_token)
        ids = list(eos_token_ids)
        if self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.chat_template = chat_template
        self.all_special_ids: list[int] = sorted(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        self._special_set = frozenset(self.all_special_ids)
        self._compiled_template: Any = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, generation_config.json (eos ids) and the
        chat template (tokenizer_config's `chat_template` or chat_template.jinja)."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"missing file: {path}")
        tok = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            p = model_dir / name
            if p.is_file():
                value = json.loads(p.read_text(encoding="utf-8")).get("eos_token_id")
                eos += [value] if isinstance(value, int) else list(value or [])
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_path = model_dir / "chat_template.jinja"
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text(encoding="utf-8")
        return cls(tok, config, tuple(eos), template)

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
        """Token ids of `text`; with `add_special_tokens`, bos (etc.) as the tokenizer adds them."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (special tokens left out when `skip_special_tokens`)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        """The token string of each id (None for an id outside the vocabulary)."""
        return [self._tok.id_to_token(i) for i in ids]

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_set

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
