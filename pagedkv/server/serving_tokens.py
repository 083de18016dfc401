"""vLLM's POST /tokenize (a prompt, or chat messages through the template) and /detokenize.

Both run in the server's tokenizer threads (`OpenAIServing.run_tokenizer`), never on the event
loop, with the completion routes' bound: a prompt over `max_model_len` is refused after
tokenizing only a prefix, and /detokenize takes at most `max_model_len` ids."""

from __future__ import annotations

from pagedkv.http.errors import APIError
from pagedkv.http.prompt_render import render_chat, tokenize_chat
from pagedkv.http.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from pagedkv.server.serving import OpenAIServing


def tokenize(serving: OpenAIServing,
             req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
    """The token ids the completions or chat endpoint would feed the model for `req` (400 when
    they could not fit, as there). Call it in `serving.run_tokenizer`."""
    serving.check_model(req.model)
    if isinstance(req, TokenizeChatRequest):
        chat = ChatCompletionRequest(
            messages=req.messages, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template_kwargs=req.chat_template_kwargs)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        if req.add_special_tokens:
            ids = serving.encode_prompt(render_chat(serving, chat, tools),
                                        add_special_tokens=True, param="messages")
        else:
            ids = tokenize_chat(serving, chat, tools)
    else:
        ids = serving.encode_prompt(req.prompt, add_special_tokens=req.add_special_tokens)
    strs = None
    if req.return_token_strs:
        strs = [s or "" for s in serving.tokenizer.convert_ids_to_tokens(ids)]
    return TokenizeResponse(count=len(ids), max_model_len=serving.max_model_len, tokens=ids,
                            token_strs=strs)


def detokenize(serving: OpenAIServing, req: DetokenizeRequest) -> DetokenizeResponse:
    """The text of `req.tokens` (400 for an id outside the vocabulary, or for more ids than
    `max_model_len`). Call it in `serving.run_tokenizer`."""
    serving.check_model(req.model)
    if len(req.tokens) > serving.max_model_len:
        raise APIError(f"{len(req.tokens)} token ids are more than this model's maximum "
                       f"context length of {serving.max_model_len}", param="tokens")
    vocab = serving.engine.vocab_size
    bad = next((t for t in req.tokens if t >= vocab), None)
    if bad is not None:
        raise APIError(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return DetokenizeResponse(prompt=serving.tokenizer.decode(req.tokens,
                                                              skip_special_tokens=False))
