"""Prompt token ids from a backend's POST /tokenize, for a kv-aware router started without
--model: the backend applies its own tokenizer and chat template, so the ids are exactly the
ones its completions and chat endpoints feed the model (vLLM has the same route, so this also
works in front of vLLM servers).

`tokenize_call(path, body)` turns a request body into the /tokenize body (or the token ids a
completions request already carries); `BackendTokenizer` sends it. Any failure (a bad body, a
backend that answers no ids in time) means no ids: the request is then placed by load alone.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import httpx

from pagedkv.router.prompt import CHAT_COMPLETIONS, COMPLETIONS, MAX_PROMPT_TOKENS

logger = logging.getLogger("pagedkv.router")

TOKENIZE_ROUTE = "/tokenize"
# the chat fields that shape the rendered prompt (the /tokenize chat form takes exactly these)
_CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message",
                "chat_template_kwargs", "tools")


@dataclass(frozen=True)
class TokenizeCall:
    """How to get a body's prompt ids: `payload` for /tokenize, or `token_ids` when the body
    carries them; `cache_salt` goes into the first block's hash."""

    payload: dict[str, Any] | None
    token_ids: list[int] | None
    cache_salt: str | None


def _is_ids(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def _first_prompt(prompt: Any) -> str | list[int] | None:
    """The prompt a completions request is placed by: its only or first one (text or ids)."""
    if isinstance(prompt, str) or _is_ids(prompt):
        return prompt
    if isinstance(prompt, list) and prompt and (isinstance(prompt[0], str)
                                                or _is_ids(prompt[0])):
        return prompt[0]
    return None


def tokenize_call(path: str, body: bytes) -> TokenizeCall | None:
    """The /tokenize call for a completions or chat body; None when the body has no usable
    prompt (the backend will answer its 400)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    salt = parsed.get("cache_salt") if isinstance(parsed.get("cache_salt"), str) else None
    model = {"model": parsed["model"]} if isinstance(parsed.get("model"), str) else {}
    if path == COMPLETIONS:
        prompt = _first_prompt(parsed.get("prompt"))
        if isinstance(prompt, list):
            return TokenizeCall(None, prompt, salt)
        if isinstance(prompt, str):
            special = parsed.get("add_special_tokens") is not False  # the server's default
            return TokenizeCall({**model, "prompt": prompt, "add_special_tokens": special},
                                None, salt)
        return None
    if path == CHAT_COMPLETIONS and isinstance(parsed.get("messages"), list):
        fields = {k: parsed[k] for k in _CHAT_FIELDS if parsed.get(k) is not None}
        special = parsed.get("add_special_tokens") is True  # a chat's default: false
        return TokenizeCall({**model, **fields, "add_special_tokens": special}, None, salt)
    return None


class BackendTokenizer:
    """Asks backends for token ids with `client` (`headers`: the backends' key), each call
    bounded by `timeout_s`."""

    def __init__(self, client: httpx.AsyncClient, headers: dict[str, str], *,
                 timeout_s: float = 2.0) -> None:
        self.client = client
        self.headers = headers
        self.timeout_s = timeout_s

    async def token_ids(self, backend_url: str, call: TokenizeCall) -> list[int] | None:
        """The prompt's ids (from the body, or from `backend_url`'s /tokenize); None when the
        backend cannot say (a 4xx, a timeout, an answer without ids) or the prompt is longer
        than the router hashes."""
        ids = call.token_ids
        if ids is None and call.payload is not None:
            try:
                async with asyncio.timeout(self.timeout_s):  # in all, not per read
                    resp = await self.client.post(backend_url + TOKENIZE_ROUTE,
                                                  json=call.payload, headers=self.headers)
                tokens = resp.json().get("tokens") if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError, AttributeError, TimeoutError) as exc:
                logger.debug("cannot tokenize on %s: %r", backend_url, exc)
                return None
            if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
                ids = tokens
        if ids is None or len(ids) > MAX_PROMPT_TOKENS:
            return None
        return ids
