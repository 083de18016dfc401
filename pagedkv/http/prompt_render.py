"""Prompts to token ids, as the server does it: a completion's prompt(s) (`tokenize_prompts`)
and a chat's messages through the model's chat template (`render_chat`, `tokenize_chat`).

Torch-free (no engine): the router imports these to tokenize exactly as its backends do. Each
takes a `PromptEncoder` (the tokenizer and how a prompt text is encoded: the server's
`OpenAIServing`, bounded by the model's context, or a `CappedPromptEncoder` over a bare tokenizer,
the router's) and mutates nothing."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from jinja2.exceptions import TemplateError

from pagedkv.http.errors import APIError
from pagedkv.http.protocol import ChatCompletionRequest

if TYPE_CHECKING:
    from pagedkv.model.tokenizer import Tokenizer


class PromptEncoder(Protocol):
    """What these functions read of their `serving` argument (`OpenAIServing` has both)."""

    tokenizer: Any

    def encode_prompt(self, text: str, *, add_special_tokens: bool, param: str = "prompt",
                      bounded: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class CappedPromptEncoder:
    """A `PromptEncoder` over a bare tokenizer, for a process that tokenizes prompts to place
    them rather than to serve them (the router): every text is bounded by `max_tokens`, even
    one the request truncates (`bounded` is not read), and one past it raises ValueError
    (`PromptTooLongError`), not a 400."""

    tokenizer: Tokenizer
    max_tokens: int

    def encode_prompt(self, text: str, *, add_special_tokens: bool, param: str = "prompt",
                      bounded: bool = True) -> list[int]:
        return self.tokenizer.encode_bounded(text, self.max_tokens,
                                             add_special_tokens=add_special_tokens, what=param)


def tokenize_prompts(serving: PromptEncoder, prompt: str | list,
                     bounded: bool = True, add_special_tokens: bool = True) -> list[list[int]]:
    """The prompt(s) of a completions request as token-id lists (strings get the BOS token
    unless `add_special_tokens` is false); `bounded` as for `OpenAIServing.encode_prompt`.
    Runs in a tokenizer thread (`serving.run_tokenizer`)."""
    if isinstance(prompt, str):
        return [serving.encode_prompt(prompt, add_special_tokens=add_special_tokens,
                                      bounded=bounded)]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], str):
        return [serving.encode_prompt(p, add_special_tokens=add_special_tokens, bounded=bounded)
                for p in prompt]
    return [list(p) for p in prompt]


def tokenize_chat(serving: PromptEncoder, req: ChatCompletionRequest,
                  tools: list[dict] | None = None) -> list[int]:
    """The token ids of `render_and_tokenize_chat`."""
    return render_and_tokenize_chat(serving, req, tools)[1]


def render_and_tokenize_chat(serving: PromptEncoder, req: ChatCompletionRequest,
                             tools: list[dict] | None = None) -> tuple[str, list[int]]:
    """`render_chat` and its token ids, tokenized without adding special tokens (the template
    writes them), as vLLM does (unless the request sets `add_special_tokens`); over-long is a
    400 unless the request truncates its prompt. Runs in a tokenizer thread
    (`serving.run_tokenizer`)."""
    text = render_chat(serving, req, tools)
    return text, serving.encode_prompt(text, add_special_tokens=bool(req.add_special_tokens),
                                       param="messages",
                                       bounded=req.truncate_prompt_tokens is None)


def render_chat(serving: PromptEncoder, req: ChatCompletionRequest,
                tools: list[dict] | None = None) -> str:
    """The chat template applied to the messages (and `tools`, which Hugging Face templates
    take, and `chat_template_kwargs`). 400 when the model has no chat template."""
    messages = [template_message(m) for m in req.messages]
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_ARGS & set(kwargs))
    if reserved:
        raise APIError(f"chat_template_kwargs must not set {reserved}",
                       param="chat_template_kwargs")
    if tools is not None:
        kwargs["tools"] = tools
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError("continue_final_message needs add_generation_prompt set to false",
                       param="continue_final_message")
    try:
        text = serving.tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt, **kwargs)
    except (ValueError, TypeError, TemplateError) as exc:
        raise APIError(f"cannot apply the chat template: {exc}", param="messages") from exc
    if req.continue_final_message:
        text = _up_to_final_message(text, messages[-1]["content"])
    return text


# Names the server passes to the template itself.
RESERVED_TEMPLATE_ARGS = frozenset({"messages", "add_generation_prompt", "tools", "bos_token",
                                    "eos_token", "pad_token"})


def _up_to_final_message(text: str, final: str) -> str:
    """The rendered chat cut right after the final message's content (what the template puts
    after it, such as an end-of-turn token, goes), so the model continues that message."""
    at = text.rfind(final) if final else -1
    if at < 0:
        raise APIError("continue_final_message needs a final message with content that the "
                       "chat template renders verbatim", param="continue_final_message")
    return text[:at + len(final)]


def template_message(message: Any) -> dict[str, Any]:
    """A request message as chat templates expect it: text content, and tool calls with their
    arguments parsed back into objects (Hugging Face templates render them as JSON)."""
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                arguments = call.function.arguments
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
        out["tool_calls"] = calls
    return out
