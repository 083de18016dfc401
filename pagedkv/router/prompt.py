"""A request body -> its prompt's token ids -> the chained block hashes the engine will compute.

The router tokenizes exactly as `pagedkv serve` does, with the server's own functions
(`tokenize_prompts`, `tokenize_chat`: the same tokenizer, chat template and special tokens),
and hashes with the engine's `RequestBlockHasher` under the backends' block size and hash
algorithm, `cache_salt` in the first block. So a prompt's hashes here equal the ones a backend
publishes in its KV events and looks up in its prefix cache. A completions request with a list
of prompts is placed by its first prompt (the only one tokenized). `add_special_tokens` is read
as the server reads it (a completion's BOS unless false; a chat's only when true). A body the
server would reject gets no hashes (it is placed by load alone and the backend answers the
400). Without a local tokenizer (a router started without --model) the token ids come from a
backend's /tokenize (remote_tokens.py) and only the hashing happens here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pydantic

from pagedkv.http.errors import APIError
from pagedkv.http.prompt_render import CappedPromptEncoder, tokenize_chat, tokenize_prompts
from pagedkv.http.protocol import ChatCompletionRequest, CompletionRequest
from pagedkv.kv.hashing import RequestBlockHasher
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.router.policies.base import RouteRequest

logger = logging.getLogger("pagedkv.router")

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


MAX_PROMPT_TOKENS = 1 << 17  # a longer prompt is not hashed (the backend will refuse it anyway)


@dataclass
class _HashedPrompt:
    """What `RequestBlockHasher` reads of a request."""

    all_token_ids: list[int]
    cache_salt: str | None
    lora_name: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)


def first_prompt(prompt: str | list) -> str | list:
    """The prompt a completions request is placed by (a validated `prompt`): its only one, or
    the first of a list of texts or of token-id lists (the others are not tokenized)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return prompt[0]
    return prompt


class PromptHasher:
    """Token ids and block hashes of request bodies. Thread-safe (call it off the event loop:
    tokenizing a long prompt takes milliseconds). With `tokenizer` None it only hashes token
    ids (`route_request_from_ids`); `token_ids` then raises ValueError."""

    def __init__(self, tokenizer: Tokenizer | None, *, block_size: int, hash_algo: str) -> None:
        self.tokenizer = tokenizer
        self._encoder = (CappedPromptEncoder(tokenizer, MAX_PROMPT_TOKENS) if tokenizer is not None
                         else None)
        self.block_size = block_size
        self.hash_algo = hash_algo
        self._hasher = RequestBlockHasher(hash_algo, block_size)

    def token_ids(self, path: str, body: bytes) -> tuple[list[int], str | None] | None:
        """(prompt token ids, cache_salt) of a /v1/completions or /v1/chat/completions body;
        None when the server would reject the body."""
        if self._encoder is None:
            raise ValueError("this PromptHasher has no tokenizer: tokenize on a backend")
        try:
            if path == COMPLETIONS:
                completion = CompletionRequest.model_validate_json(body)
                return (tokenize_prompts(self._encoder, first_prompt(completion.prompt),
                                         add_special_tokens=completion.add_special_tokens
                                         is not False)[0], completion.cache_salt)
            if path == CHAT_COMPLETIONS:
                chat = ChatCompletionRequest.model_validate_json(body)
                tools = ([t.model_dump(exclude_none=True) for t in chat.tools] if chat.tools
                         else None)  # the template sees them, as on the server (tools.py)
                return tokenize_chat(self._encoder, chat, tools), chat.cache_salt
        except (pydantic.ValidationError, APIError, ValueError) as exc:
            logger.debug("cannot tokenize a %s body: %s", path, exc)
        return None

    def block_hashes(self, token_ids: list[int], cache_salt: str | None) -> list[bytes]:
        """The chained hashes of the full blocks of `token_ids`, as the engine computes them."""
        prompt = _HashedPrompt(list(token_ids), cache_salt)
        return self._hasher(prompt, prompt.block_hashes)

    def route_request(self, path: str, body: bytes, session: str | None = None) -> RouteRequest:
        """The `RouteRequest` of a body (no hashes when it cannot be tokenized)."""
        parsed = self.token_ids(path, body)
        if parsed is None:
            return RouteRequest(session=session)
        return self.route_request_from_ids(*parsed, session)

    def route_request_from_ids(self, token_ids: list[int], cache_salt: str | None,
                               session: str | None = None) -> RouteRequest:
        """The `RouteRequest` of a prompt already tokenized."""
        return RouteRequest(prompt_tokens=len(token_ids),
                            block_hashes=tuple(self.block_hashes(token_ids, cache_salt)),
                            session=session)
