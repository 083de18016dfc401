"""vLLM's POST /tokenize and POST /detokenize (serving_tokens.py), run in a tokenizer thread."""

from __future__ import annotations

from fastapi import APIRouter, Request

from pagedkv.http.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from pagedkv.server.routes import ERROR_RESPONSES
from pagedkv.server.serving_tokens import detokenize, tokenize

router = APIRouter()


@router.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
async def tokenize_route(body: TokenizeCompletionRequest | TokenizeChatRequest, raw: Request
                         ) -> TokenizeResponse:
    serving = raw.app.state.serving
    return await serving.run_tokenizer(tokenize, serving, body)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
async def detokenize_route(body: DetokenizeRequest, raw: Request) -> DetokenizeResponse:
    serving = raw.app.state.serving
    return await serving.run_tokenizer(detokenize, serving, body)
