"""vLLM's POST /tokenize (a prompt, or chat messages through the template) and /detokenize."""

from __future__ import annotations

from pagedkv.server.errors import APIError
from pagedkv.server.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from pagedkv.server.serving import OpenAIServing
from pagedkv.server.serving_chat import render_chat


def tokenize(serving: OpenAIServing,
             req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
    """The token ids the completions or chat endpoint would feed the model for `req`."""
    serving.check_model(req.model)
    if isinstance(req, TokenizeChatRequest):
        chat = ChatCompletionRequest(
            messages=req.messages, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template_kwargs=req.chat_template_kwargs)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        text = render_chat(serving, chat, tools)
        ids = serving.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    else:
        ids = serving.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    strs = None
    if req.return_token_strs:
        strs = [s or "" for s in serving.tokenizer.convert_ids_to_tokens(ids)]
    return TokenizeResponse(count=len(ids), max_model_len=serving.max_model_len, tokens=ids,
                            token_strs=strs)


def detokenize(serving: OpenAIServing, req: DetokenizeRequest) -> DetokenizeResponse:
    """The text of `req.tokens` (400 for an id outside the vocabulary)."""
    serving.check_model(req.model)
    vocab = serving.engine.vocab_size
    bad = next((t for t in req.tokens if t >= vocab), None)
    if bad is not None:
        raise APIError(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return DetokenizeResponse(prompt=serving.tokenizer.decode(req.tokens,
                                                              skip_special_tokens=False))
