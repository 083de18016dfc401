"""Request fields vLLM 0.32 accepts beyond ours, and its rule for fields nobody defines.

`VllmRequestFields` is mixed into the completions and chat request models:
- honoured: `request_id` (the response id is `cmpl-<request_id>` / `chatcmpl-<request_id>`; an
  `X-Request-Id` header wins, as in vLLM), `return_token_ids` (choices carry `token_ids`, the
  response `prompt_token_ids`), `add_special_tokens` (completions default true, chat false),
  `detokenize` (false: empty text, use with `return_token_ids`; no stop strings then),
  `spaces_between_special_tokens` (false, with `skip_special_tokens` false: added tokens in a
  row are written without the spaces a decoder may put between them, as vLLM's detokenizer).
  Chat's `echo` (declared on the chat request) prepends the last message when it is the
  assistant's, as vLLM does; chat's `return_prompt_text` puts the rendered chat prompt in the
  answer's `prompt_text` (streaming: each choice's role chunk). vLLM's completions API has no
  such field.
- accepted as documented no-ops (they have no meaning here, or are metadata for OpenAI's
  platform or for proxies): `service_tier`, `store`, `metadata`, `modalities`,
  `reasoning_effort`, `include_reasoning`,
  `vllm_xargs`, `no_stop_trim`, `separate_reasoning`, `stream_reasoning`, `session_id`.
- beam search: `use_beam_search` with `n` beams (all returned, best first), `length_penalty`,
  `early_stopping` (true, false or "never"); not with `stream` (400, as vLLM).
- 400: `return_hidden_states: true` (not implemented).

A field no API of ours defines is dropped before validation and listed in
`ignored_fields()`; the handler logs one warning naming them (vLLM's rule: proxies add their
own), or answers 400 naming them when the server runs with `--strict-request-fields`. A bad
value of a declared field is still a 400 naming it.
"""

from __future__ import annotations

import functools
import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, model_validator

from pagedkv.http.errors import APIError

logger = logging.getLogger("pagedkv.server")

XargValue = str | int | float | list[str | int | float]


@functools.cache
def _declared_names(model: type[BaseModel]) -> frozenset[str]:
    """The field names and aliases `model` declares (computed once per class: a request's
    validation runs on the router's and server's hot path)."""
    fields = model.model_fields
    return frozenset(fields) | {f.alias for f in fields.values() if f.alias}


class IgnoresUnknownFields(BaseModel):
    """A request model that drops top-level fields it does not declare (vLLM's rule) and
    remembers their names for `check_request_fields`."""

    _ignored_fields: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _drop_unknown_fields(cls, data: Any, handler: Any) -> Any:
        """Validate without the fields the model does not declare; remember their names."""
        unknown: list[str] = []
        if isinstance(data, dict):
            known = _declared_names(cls)
            unknown = sorted(k for k in data if k not in known)
            if unknown:
                data = {k: v for k, v in data.items() if k in known}
        result = handler(data)
        if unknown and isinstance(result, IgnoresUnknownFields):
            result._ignored_fields = unknown
        return result

    def ignored_fields(self) -> list[str]:
        """The request's top-level fields that no API of ours defines (dropped)."""
        return list(self._ignored_fields)


class VllmRequestFields(IgnoresUnknownFields):
    """vLLM's extra request fields (see the module docstring for what each does here)."""

    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    return_token_ids: bool | None = None
    add_special_tokens: bool | None = None
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    vllm_xargs: dict[str, XargValue] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    modalities: list[str] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    include_reasoning: bool = True
    no_stop_trim: bool = False
    return_hidden_states: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    session_id: str | None = None


def check_request_fields(req: IgnoresUnknownFields, *, strict: bool) -> None:
    """400 for what cannot be done (hidden states, stop strings without
    detokenizing) and, when `strict`, for unknown fields; otherwise one warning naming them."""
    if isinstance(req, VllmRequestFields):
        _check_vllm_fields(req)
    unknown = req.ignored_fields()
    if not unknown:
        return
    if strict:
        raise APIError(f"Unknown fields in the request: {unknown} (this server runs with "
                       "--strict-request-fields)", param=unknown[0])
    logger.warning("The request's fields %s are not defined by this API and were ignored",
                   unknown)


def _check_vllm_fields(req: VllmRequestFields) -> None:
    if req.return_hidden_states:
        raise APIError("return_hidden_states is not supported by this server",
                       param="return_hidden_states")
    if not req.detokenize and getattr(req, "stop", None):
        raise APIError("stop strings need detokenize set to true", param="detokenize")


def response_id(prefix: str, req: VllmRequestFields, header_request_id: str | None,
                fallback: str) -> str:
    """vLLM's response id: `<prefix>-<X-Request-Id header or request_id>`, else `fallback`."""
    base = header_request_id or req.request_id
    return f"{prefix}-{base}" if base else fallback
